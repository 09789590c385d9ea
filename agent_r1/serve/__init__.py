"""`agent-r1 serve`: the OpenAI-compatible API (chat with tools, token-id completions) over any engine."""

from agent_r1.serve.app import ServedModel, create_app

__all__ = ["ServedModel", "create_app"]
