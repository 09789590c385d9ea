"""`RemoteEngine`: the `Engine` interface over HTTP, for vLLM, SGLang or `agent-r1 serve`.

Token ids in, token ids + log-probs out, through the OpenAI-compatible `/v1/completions` endpoint
with vLLM's extensions: `prompt` is a list of token ids, `return_token_ids` asks for the sampled ids
(older vLLM: `return_tokens_as_token_ids` makes `logprobs.tokens` read "token_id:N", which is parsed
as a fallback), `logprobs=0` for the sampled tokens' log-probs, and `include_stop_str_in_output` so a
response that stopped at `</tool_call>` still contains it. Nothing is re-tokenized on this side.

One HTTP request per prompt, sent concurrently, each with its own seed (`seed + i`, as `LocalEngine`
does), so the server batches them and a group of identical prompts still gets distinct samples.

Log-probs: `agent-r1 serve` returns log-softmax(logits / temperature), the quantity the trainer
recomputes. vLLM returns the raw model's by default; start it with `--logprobs-mode processed_logprobs`
to get the same quantity.

Weight sync: `load_weights(state, version, between_tokens)` (and `sync_weights(model)`, which loads
the model's full state) writes the weights as safetensors under `sync_dir`, which must be on a
filesystem the server reads, under the same path, and has the server load them with its own mechanism:
- `agent-r1 serve`: `POST /v1/load_weights` (strict; swaps between batches under a lock, or with
  `between_tokens` at the next token boundary);
- `vllm serve` (started with `VLLM_SERVER_DEV_MODE=1`, which exposes its RL endpoints): `/pause?mode=wait`
  (running requests finish), or with `between_tokens` `/pause?mode=keep` (running requests freeze where
  they are and go on with the new weights: the cleared cache makes vLLM recompute their keys on them);
  then `/collective_rpc` `reload_weights` from the directory (vLLM's in-place reload),
  `/update_weight_version`, `/resume`. The prefix cache is dropped either way.
Versions: every `GenerateOutput.versions` says which weights sampled each token. `agent-r1 serve`
reports them (`token_versions`); for vLLM, which does not, every token gets the version that was
current when the request was sent: conservative, since a token can only be that old or newer.
Version check: the engine reads the server's version after every `generate` call. It must be the one
current when the call began, so a rollout never mixes two policies silently; once partial rollouts
are on (`load_weights(..., between_tokens=True)`), any version this engine pushed since, including one
whose load is still in flight, is fine too. A version this engine never pushed (another client changed
the weights) is always an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import httpx

from agent_r1.engines.protocol import (
    GenerateOutput,
    SamplingParams,
    TokenCallback,
    alias_key,
    full_state_dict,
    no_cohort,
    replay_tokens,
)
from agent_r1.utils.paths import save_tensors_atomic

if TYPE_CHECKING:
    import torch


class RemoteEngineError(RuntimeError):
    """The server refused or failed a request (the message is the server's)."""


class RemoteEngine:
    """Batched async generation by an OpenAI-compatible server that speaks token ids."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        max_context: int | None = None,
        timeout: float = 600.0,
        max_connections: int = 256,
        api_key: str | None = None,
        sync_dir: str | None = None,
    ) -> None:
        """`base_url` is the server root or its /v1. The model card comes from `/v1/models` once, now:
        `model` and `max_context` default to its id and `max_model_len`, and it tells a vLLM server
        (`owned_by: vllm`) from agent-r1 serve. `sync_dir` is where `sync_weights` writes the weights."""
        self.root = base_url.rstrip("/").removesuffix("/v1")
        self.base_url = self.root + "/v1"
        self.timeout = timeout
        self.limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}
        card = self._model_card(model)
        max_context = max_context or int(card.get("max_model_len") or 0) or None
        if max_context is None:
            raise ValueError(f"{self.base_url}/models reports no max_model_len: pass max_context")
        self.model = model or card["id"]
        self.max_context = max_context
        self.sync_dir = sync_dir
        self.is_vllm = card.get("owned_by") == "vllm"
        self.weights_version = 0  # the version of the last weights the server accepted from this engine
        self.partial_rollouts = False  # set by load_weights(between_tokens=True): responses may span versions
        self._newest = 0  # the newest version sent: weights_version, or one the server is loading right now
        self._synced = False  # before the first sync the server's own weights are the policy
        self._token_texts: dict[int, str] = {}  # EOS token id -> its text (vLLM servers)

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        on_token: TokenCallback | None = None,
        *,
        images: list | None = None,
    ) -> list[GenerateOutput]:
        """Sample one response per prompt; requests go out together, so the server can batch them.
        Once weights were synced, the server's weights version is checked after the call: versions
        only grow, so a change before or during the call shows then (one request per call, not two)."""
        if images and any(images):
            raise ValueError("a remote engine does not take images yet: use rollout.engine=local for a VLM")
        client = self._client()
        start = self.weights_version
        outs = list(await asyncio.gather(*(self._one(client, p, params, i, start) for i, p in enumerate(prompts))))
        await self._check_version(client, start)
        return replay_tokens(outs, on_token)  # the responses come whole: their tokens are replayed

    async def _check_version(self, client: httpx.AsyncClient, start: int) -> None:
        """The server must serve `start`, the version current when the call began, or with partial
        rollouts any version pushed since: `_newest` is set before a load is posted, so a load in flight
        on another thread (the server switched, `weights_version` not yet updated) is no error."""
        if not self._synced:
            return
        path = f"{self.root}/weight_info" if self.is_vllm else f"{self.base_url}/models"
        try:
            r = await client.get(path)
            r.raise_for_status()
        except httpx.HTTPError as exc:
            raise RemoteEngineError(f"{self.base_url}: {type(exc).__name__}: {exc}") from exc
        body = r.json()
        served = body.get("weight_version") if self.is_vllm else _card(body, self.model).get("weights_version")
        newest = self._newest if self.partial_rollouts else start
        if not start <= _as_int(served, default=-1) <= newest:
            pushed = str(start) if newest == start else f"{start}..{newest}"
            raise RemoteEngineError(
                f"{self.root} serves weights version {served}, not {pushed} (what this trainer pushed): "
                "another client changed them, so this rollout would mix two policies"
            )

    def sync_weights(self, model: torch.nn.Module, version: int | None = None, between_tokens: bool = False) -> None:
        """Have the server sample from `model`'s current weights (once per RL step, after the update),
        LoRA merged, under the plain model's names, as the next version."""
        self.load_weights(full_state_dict(model), version, between_tokens)

    def load_weights(
        self, state: Mapping[str, torch.Tensor], version: int | None = None, between_tokens: bool = False
    ) -> int:
        """Have the server sample from `state` (every weight, under the plain model's names) as `version`
        (default: the last + 1); returns the number of tensors, once the server uses them.

        `between_tokens`: running requests are not waited for; they go on with the new weights (partial
        rollouts), and from then on `generate` accepts responses that span versions (module docstring).
        The weights go to `<sync_dir>/weights/model.safetensors` through a temporary file and a rename,
        so the server never reads a half-written file."""
        if self.sync_dir is None:
            raise ValueError("weight sync needs sync_dir: a directory the server can read (RemoteEngine(sync_dir=...))")
        version = self.weights_version + 1 if version is None else version
        if self._synced and version <= self.weights_version:  # the first load may say which version it is
            raise ValueError(f"weights version {version} is not newer than {self.weights_version}, the last pushed")
        folder, path, count = self._write(state)
        self.partial_rollouts |= between_tokens
        self._newest = version  # before the post: a generate that ends while it is in flight may see it
        try:
            self._load(folder, path, version, between_tokens)
        except BaseException:
            self._newest = self.weights_version
            raise
        self.weights_version, self._synced = version, True
        return count

    def _write(self, state: Mapping[str, torch.Tensor]) -> tuple[str, str, int]:
        """(folder, file, tensors): `state` written atomically where the server reads it."""
        folder = os.path.join(os.path.abspath(self.sync_dir), "weights")  # vLLM reloads every file of a folder
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "model.safetensors")
        tensors = _unaliased(state)
        save_tensors_atomic(tensors, path, tmp_dir=os.path.dirname(self.sync_dir + "/"))  # not in the folder vLLM reads
        return folder, path, len(tensors)

    def _load(self, folder: str, path: str, version: int, between_tokens: bool) -> None:
        """Have the server load the written weights as `version` (module docstring: how, per server)."""
        if not self.is_vllm:
            body = {"path": path, "version": version, "between_tokens": between_tokens}
            self._post(f"{self.base_url}/load_weights", json=body)
            return
        mode = "keep" if between_tokens else "wait"
        self._post(f"{self.root}/pause", params={"mode": mode, "clear_cache": "true"})
        try:
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": folder}}
            self._post(f"{self.root}/collective_rpc", json=rpc)
            self._post(f"{self.root}/update_weight_version", json={"new_version": str(version)})
        finally:
            self._post(f"{self.root}/resume")

    def _post(self, url: str, **kw: Any) -> dict[str, Any]:
        try:
            r = httpx.post(url, timeout=self.timeout, headers=self.headers, **kw)
        except httpx.HTTPError as exc:
            raise RemoteEngineError(f"{url}: {type(exc).__name__}: {exc}") from exc
        if r.status_code == 404 and self.is_vllm:
            raise RemoteEngineError(
                f"{url} does not exist: start vllm serve with VLLM_SERVER_DEV_MODE=1 for weight sync"
            )
        if r.status_code != 200:
            raise RemoteEngineError(f"{url} refused the weights ({r.status_code}): {_error_message(r)}")
        return r.json() if r.content else {}

    def cohort(self, size: int) -> contextlib.AbstractContextManager[Any]:
        """The server batches as requests arrive: no cohort to keep."""
        return no_cohort(size)

    @property
    def stats(self) -> dict[str, float]:
        return {}

    def sleep(self) -> None:
        """The server's memory is the server's: nothing to give back here."""

    def wait_idle(self, timeout: float = 60.0) -> bool:
        return True  # every request this engine makes is awaited by its caller

    def close(self) -> None:
        """Forget the connection pools (each belongs to an event loop, closed with it or by `aclose`)."""
        self._clients.clear()

    async def aclose(self) -> None:
        """Close this event loop's connection pool."""
        client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()

    def request_body(self, prompt: list[int], params: SamplingParams, index: int = 0) -> dict[str, Any]:
        """The `/v1/completions` body of one prompt (fields vLLM and agent-r1 serve both understand)."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
        }
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = params.seed + index
        if params.grammar is not None:  # vLLM's constrained decoding field (agent-r1 serve reads it too)
            body["structured_outputs"] = {"grammar": params.grammar}
        return body

    async def _one(
        self, client: httpx.AsyncClient, prompt: list[int], params: SamplingParams, i: int, version: int
    ) -> GenerateOutput:
        try:
            r = await client.post("/completions", json=self.request_body(prompt, params, i))
        except httpx.HTTPError as exc:
            raise RemoteEngineError(f"{self.base_url}: {type(exc).__name__}: {exc}") from exc
        if r.status_code != 200:
            raise RemoteEngineError(f"{self.base_url} answered {r.status_code}: {_error_message(r)}")
        out = parse_choice(r.json()["choices"][0], len(prompt), version)
        if self.is_vllm and out.finish_reason == "eos":  # vLLM's text ends in the EOS token's; ours never does
            out.text = out.text.removesuffix(await self._token_text(client, out.token_ids[-1]))
        return out

    async def _token_text(self, client: httpx.AsyncClient, token_id: int) -> str:
        """The text of one token, from vLLM's `/detokenize` (once per token id)."""
        if token_id not in self._token_texts:
            try:
                r = await client.post(f"{self.root}/detokenize", json={"model": self.model, "tokens": [token_id]})
                r.raise_for_status()
            except httpx.HTTPError as exc:
                raise RemoteEngineError(f"{self.root}/detokenize: {type(exc).__name__}: {exc}") from exc
            self._token_texts[token_id] = r.json()["prompt"]
        return self._token_texts[token_id]

    def _client(self) -> httpx.AsyncClient:
        """One connection pool per event loop (`AgentEnvLoop.run_sync` runs a new loop per call)."""
        loop = asyncio.get_running_loop()
        for old in [k for k in self._clients if k.is_closed()]:
            del self._clients[old]
        if loop not in self._clients:
            self._clients[loop] = httpx.AsyncClient(
                base_url=self.base_url, timeout=self.timeout, limits=self.limits, headers=self.headers
            )
        return self._clients[loop]

    def _model_card(self, model: str | None) -> dict[str, Any]:
        try:
            r = httpx.get(f"{self.base_url}/models", timeout=self.timeout, headers=self.headers)
            r.raise_for_status()
        except httpx.HTTPError as exc:
            raise RemoteEngineError(f"cannot list models at {self.base_url}: {exc}") from None
        return _card(r.json(), model, self.base_url)


def parse_choice(choice: dict[str, Any], prompt_len: int, version: int) -> GenerateOutput:
    """A `/v1/completions` choice -> GenerateOutput. vLLM reports EOS as finish_reason "stop" with no
    stop_reason (a stop token id, e.g. a second EOS, as an int); a stop string as that string. Each
    token's version is the server's `token_versions`, else `version`, the one current at the request."""
    logprobs = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if ids is None:  # older vLLM: only "token_id:N" strings
        ids = [int(str(t).removeprefix("token_id:")) for t in logprobs.get("tokens") or []]
    token_logprobs = [float(x) if x is not None else 0.0 for x in logprobs.get("token_logprobs") or []]
    if len(token_logprobs) != len(ids):
        raise RemoteEngineError(f"the server returned {len(ids)} token ids but {len(token_logprobs)} log-probs")
    versions = choice.get("token_versions")
    versions = [version] * len(ids) if versions is None else [int(v) for v in versions]
    if len(versions) != len(ids):
        raise RemoteEngineError(f"the server returned {len(ids)} token ids but {len(versions)} token versions")
    finish, stop_reason = choice.get("finish_reason"), choice.get("stop_reason")
    if finish == "length":
        reason = "length"
    elif finish == "stop":
        reason = "stop" if isinstance(stop_reason, str) else "eos"
    else:
        raise RemoteEngineError(f"unexpected finish_reason {finish!r}")
    return GenerateOutput(list(ids), token_logprobs, choice.get("text", ""), reason, prompt_len, versions)


def _card(listing: dict[str, Any], model: str | None, url: str = "") -> dict[str, Any]:
    """The model card of `model` (None: the first) in a `/v1/models` listing."""
    cards = listing.get("data", [])
    for card in cards:
        if model is None or card.get("id") == model:
            return card
    raise RemoteEngineError(f"{url} does not serve {model!r}: it serves {[c.get('id') for c in cards]}")


def _as_int(value: Any, default: int) -> int:
    """A version as the server reports it (vLLM: a string, or None before any update) as an int."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _unaliased(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, each memory under one name only (safetensors refuses shared tensors): a tied
    weight such as lm_head.weight = embed_tokens.weight is written twice, as a copy, because vLLM's
    in-place reload leaves a layer it is given no weights for unloaded."""
    out: dict[str, torch.Tensor] = {}
    seen = set()
    for name, t in state.items():
        key = alias_key(t)
        out[name] = t.detach().clone() if key in seen else t.detach().contiguous()
        seen.add(key)
    return out


def _error_message(r: httpx.Response) -> str:
    try:
        return str(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return r.text[:300]
