"""Request bodies of the OpenAI-compatible API, and the OpenAI-style error every failure becomes.

Only requests are pydantic models: they are where bad input must be caught and named. Field names and
meanings follow the OpenAI API, plus the vLLM extensions a rollout engine needs (`return_token_ids`,
`return_tokens_as_token_ids`, `include_stop_str_in_output`), so one client (`RemoteEngine`) talks to
vLLM and to `agent-r1 serve` alike. Unknown fields are ignored, as OpenAI-compatible servers do.
Responses add one agent-r1 field next to `token_ids`: `token_versions`, the weights version that
sampled each token (a response can span a `between_tokens` weight load).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOPS = 16  # stop sequences a request may give (OpenAI takes 4, vLLM any number)
MAX_STOP_CHARS = 256  # characters in one


class APIError(Exception):
    """A request the server refuses; rendered as `{"error": {...}}` with an HTTP status."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bounded_stops(cls: type, stop: str | list[str] | None) -> str | list[str] | None:
    """Stop strings are checked against every decoded token on the engine's decode thread, which all requests
    share: a client may not make that check arbitrarily long (chat `stop`, Messages `stop_sequences`)."""
    stops = [stop] if isinstance(stop, str) else stop or []
    if len(stops) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
    if longest := max((len(x) for x in stops if len(x) > MAX_STOP_CHARS), default=0):
        raise ValueError(f"a stop sequence is at most {MAX_STOP_CHARS} characters, got one of {longest}")
    return stop


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # a torch generator's seed: 64 bits, as vLLM's
    stream: bool = False
    return_token_ids: bool = False  # vLLM: put sampled (and prompt) token ids in the response

    _bounded = field_validator("stop")(bounded_stops)

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's format)


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None  # a string, or OpenAI content parts (text, image_url)
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None


class FunctionSpec(BaseModel):
    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolSpec(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}} (messages.forced_call)
    tool_choice: Any = None
    # true: the model's turn ends when it ends it, with every call it wrote; false or absent: at its first
    # call's end, as ToolEnv samples (a model that learned to stop there would run on into a made-up result)
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)  # answers sampled from the same prompt, each with its own seed (seed + k)
    logprobs: bool = False
    # {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}}: the
    # JSON ones are guaranteed by sampling under a grammar (messages.answer_grammar)
    response_format: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None  # {"include_usage": true}: a last chunk with the usage
    user: str | None = Field(None, max_length=256)  # the end user (OpenAI's field): `serve --learn` groups by it


class CompletionRequest(_Request):
    prompt: list[int] | list[list[int]] | str | list[str]  # token ids are what a rollout engine sends
    max_tokens: int | None = Field(16, ge=1)
    n: int = Field(1, ge=1, le=64)
    logprobs: int | None = Field(None, ge=0)  # any value returns the sampled token's log-prob only
    echo: Literal[False] = False
    return_tokens_as_token_ids: bool = False  # vLLM: logprobs.tokens as "token_id:N"
    include_stop_str_in_output: bool = False  # vLLM: keep the stop string at the end of the text
    structured_outputs: dict[str, Any] | None = None  # vLLM: {"grammar": EBNF} or {"json": a JSON schema}


class LoadWeightsRequest(BaseModel):
    """`/v1/load_weights`: new weights for the served model, from a file on a filesystem it shares."""

    model_config = ConfigDict(extra="ignore")

    path: str = Field(min_length=1)  # a .safetensors file holding every weight (tied ones under one name)
    version: int | None = Field(None, ge=0)  # reported by /v1/models as weights_version; None = previous + 1
    between_tokens: bool = False  # swap at the next token boundary, running requests go on with the new weights
