"""`LocalEngine`: generation with a torch model in this process, sharing weights with the trainer.

Concurrent `generate` calls (one per trajectory in the agent loop) are queued and decoded together
as one left-padded batch with a KV cache, so a turn of N×G trajectories costs one batched decode, not
N×G. The prefill runs each distinct prompt once (a GRPO group's G copies share one) and the prefix
common to all prompts once (the system prompt and tool schemas). Finished rows are dropped from the
batch and its cache as soon as they stop, so a batch costs what its still-running rows need.
Decoding runs in a worker thread, which lets the event loop keep running tool calls while the model
decodes.

Each row samples from its own seeded generator, so a request's tokens do not depend on which other
requests happened to share its batch (up to fp32 rounding differences between batch shapes).

Serving needs two more things from the decode loop, and gets them without a second code path:
`generate(..., on_token=...)` reports every sampled token as it is decoded (for streaming), and a
caller that is cancelled (a client that disconnected, a request that timed out) has its row dropped
from the batch at the next token instead of decoding to the end for nobody.

Weights change only between batches (`load_weights` and `generate_batch` share a lock), so every
response is sampled from one version of the weights and no decode step sees half of an update.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from agent_r1.models.precision import autocast, model_device
from agent_r1.rollout.engine import GenerateOutput, SamplingParams, alias_key, full_state_dict
from agent_r1.rollout.kv_cache import BufferedCache

TokenCallback = Callable[[int, int, float], None]  # (index of the prompt in its call, token id, log-prob)
RowHook = Callable[[int, int, float], bool]  # (batch row, token id, log-prob) -> keep decoding this row


@dataclass
class _Request:
    prompt: list[int]
    seed: int
    future: asyncio.Future
    on_token: Callable[[int, float], None] | None = None  # runs on the caller's event loop


class LocalEngine:
    """Batched, KV-cached sampling from a Hugging Face causal LM in this process."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int = 64,
        max_context: int | None = None,
        seed: int = 0,
        batch_wait_s: float = 0.002,
        min_shared_prefix: int = 16,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_context = max_context or int(getattr(model.config, "max_position_embeddings", 2048))
        self.batch_wait_s = batch_wait_s
        self.min_shared_prefix = min_shared_prefix  # shorter common prefixes are not worth a separate pass
        self.eos_ids = _eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self._seeds = random.Random(seed)
        self._pending: dict[SamplingParams, list[_Request]] = {}
        self._worker: asyncio.Task | None = None
        self.weights_version = 0  # bumped by every load_weights
        self._weights_lock = threading.Lock()  # held by a whole batch's decode and by a weight update

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, on_token: TokenCallback | None = None
    ) -> list[GenerateOutput]:
        """Queue the prompts; they are decoded together with whatever else is pending.

        `on_token(i, token_id, logprob)` is called on this event loop for every token sampled for
        prompt i, in order, before `generate` returns. Cancelling the call stops its rows.
        """
        loop = asyncio.get_running_loop()
        key = dataclasses.replace(params, seed=None)  # the seed is per request, not a batch property
        base = params.seed if params.seed is not None else self._seeds.getrandbits(62)
        requests = [
            _Request(list(p), base + i, loop.create_future(), on_token and functools.partial(on_token, i))
            for i, p in enumerate(prompts)
        ]
        self._pending.setdefault(key, []).extend(requests)
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._drain())
        return list(await asyncio.gather(*(r.future for r in requests)))

    async def _drain(self) -> None:
        """Run pending requests batch by batch until the queue is empty."""
        while self._pending:
            await asyncio.sleep(self.batch_wait_s)  # let trajectories still finishing tool calls join
            params, queue = next(iter(self._pending.items()))
            batch, rest = queue[: self.max_batch_size], queue[self.max_batch_size :]
            if rest:
                self._pending[params] = rest
            else:
                del self._pending[params]
            batch = [r for r in batch if not r.future.cancelled()]  # callers that gave up while queued
            if not batch:
                continue
            try:
                outputs = await asyncio.to_thread(
                    self.generate_batch,
                    [r.prompt for r in batch],
                    params,
                    [r.seed for r in batch],
                    _row_hook(batch, asyncio.get_running_loop()),
                )
            except Exception as exc:  # surface engine failures to every waiting caller
                for r in batch:
                    if not r.future.done():
                        r.future.set_exception(exc)
                continue
            for r, out in zip(batch, outputs, strict=True):
                if not r.future.done():
                    r.future.set_result(out)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Sample from `model`'s current weights: nothing to do when it is the engine's own model (the
        trainer and the engine share one object); otherwise its weights (LoRA merged) are copied in."""
        if model is not self.model:
            self.load_weights(full_state_dict(model))

    def load_weights(self, tensors: Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """Copy `tensors` into the model's weights in place, between two batches; returns their number.

        Strict, like `load_state_dict`: every name must be a tensor of the model's state dict with the
        same shape, and every tensor of the model must be given (tied weights under any of their names).
        All of it is checked before anything is copied, so refused weights (a one-line ValueError
        naming the tensor) leave the model as it was. `weights_version` becomes `version`, by default
        the previous one + 1.
        """
        target = self.model.state_dict()  # detached views of the parameters: copying into them updates them
        for name, t in tensors.items():
            if name not in target:
                raise ValueError(f"unknown tensor {name!r}: the served model has no such weight")
            if t.shape != target[name].shape:
                shapes = f"{list(t.shape)} but the served model's is {list(target[name].shape)}"
                raise ValueError(f"tensor {name!r} has shape {shapes}")
        given = {alias_key(target[name]) for name in tensors}
        if missing := next((n for n, t in target.items() if alias_key(t) not in given), None):
            raise ValueError(f"missing tensor {missing!r}: the weights must cover the whole model")
        with self._weights_lock, torch.no_grad():
            for name, t in tensors.items():
                target[name].copy_(t)
            self.weights_version = self.weights_version + 1 if version is None else version
        return len(tensors)

    def generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], on_token: RowHook | None = None
    ) -> list[GenerateOutput]:
        """Synchronously sample one response per prompt, all from the same weights.

        `on_token(row, token, logprob)` sees every sampled token; returning False aborts that row
        (finish_reason "abort"), which leaves the batch and the KV cache like a finished row.
        """
        with self._weights_lock, autocast(self.model):  # autocast is per thread: the decode thread enters it
            return self._decode(prompts, params, seeds, on_token)

    @torch.inference_mode()
    def _decode(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], on_token: RowHook | None
    ) -> list[GenerateOutput]:
        """The decode loop of `generate_batch` (shapes in comments)."""
        B, dev = len(prompts), model_device(self.model)
        if min(len(p) for p in prompts) == 0:
            raise ValueError("cannot generate from an empty prompt")
        lens = [len(p) for p in prompts]  # [B]
        budget = [min(params.max_new_tokens, self.max_context - n) for n in lens]
        gens = [torch.Generator(device="cpu").manual_seed(s) for s in seeds]
        out_ids: list[list[int]] = [[] for _ in range(B)]
        out_lp: list[list[float]] = [[] for _ in range(B)]
        finish = ["length"] * B
        rows = [i for i in range(B) if budget[i] > 0]  # request index of each live batch row
        if not rows:
            return self._outputs(prompts, out_ids, out_lp, finish)
        live = [prompts[i] for i in rows]
        index: dict[tuple[int, ...], int] = {}  # a GRPO group repeats its prompt: prefill each one once
        which = torch.tensor([index.setdefault(tuple(p), len(index)) for p in live], device=dev)  # [b] row -> prompt
        unique = [list(p) for p in index]
        cache = BufferedCache(capacity=max(len(p) for p in live) + max(budget))
        shared = self._prefill_shared_prefix(unique, cache)  # C tokens every prompt starts with, cached once
        u, C = len(unique), shared
        S = max(len(p) for p in unique) - C
        padded = [[self.pad_id] * (S - (len(p) - C)) + p[C:] for p in unique]  # left-padded after the prefix
        suffix = torch.tensor(padded, dtype=torch.long, device=dev)  # [u, S]
        attn = torch.tensor(
            [[1] * C + [0] * (S - len(p) + C) + [1] * (len(p) - C) for p in unique], device=dev
        )  # [u, C+S]
        positions = (attn.cumsum(-1) - 1).clamp(min=0)[:, C:]  # [u, S] pads do not shift positions
        logits = self.model(
            input_ids=suffix,
            attention_mask=attn,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1, :]  # [u, V]
        if u < len(live):  # one copy of each prompt's cache per row that samples from it
            cache.batch_select_indices(which)
            logits, attn = logits[which], attn[which]  # [b, V], [b, C+S]
        next_pos = torch.tensor([lens[i] for i in rows], device=dev)  # [b]
        window = max((len(s) for s in params.stop), default=0) + 2
        while True:
            tokens, logprobs = _sample(logits.float(), params, [gens[i] for i in rows])  # [b], [b]
            alive = []
            sampled = zip(rows, tokens.tolist(), logprobs.tolist(), strict=True)  # one device-to-host copy per step
            for j, (i, tok, lp) in enumerate(sampled):
                out_ids[i].append(tok)
                out_lp[i].append(lp)
                if on_token is not None and not on_token(i, tok, out_lp[i][-1]):
                    finish[i] = "abort"
                elif tok in self.eos_ids:
                    finish[i] = "eos"
                elif params.stop and _hits_stop(self.tokenizer, out_ids[i][-window:], params.stop):
                    finish[i] = "stop"
                elif len(out_ids[i]) < budget[i]:
                    alive.append(j)
            if not alive:
                break
            if len(alive) < len(rows):  # drop finished rows from the batch and from the KV cache
                sel = torch.tensor(alive, device=dev)
                cache.batch_select_indices(sel)
                attn, next_pos, tokens = attn[sel], next_pos[sel], tokens[sel]
                rows = [rows[j] for j in alive]
            attn = torch.cat([attn, attn.new_ones((len(rows), 1))], dim=1)  # [b, P+t]
            logits = self.model(
                input_ids=tokens.unsqueeze(1),  # [b, 1]
                attention_mask=attn,
                position_ids=next_pos.unsqueeze(1),  # [b, 1]
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1, :]
            next_pos = next_pos + 1
        return self._outputs(prompts, out_ids, out_lp, finish)

    def _prefill_shared_prefix(self, prompts: list[list[int]], cache: BufferedCache) -> int:
        """Run the longest prefix all prompts share once and copy its KV cache to every row.

        Agent prompts repeat a long system prompt, tool schemas and few-shot examples, so this removes
        most of the prefill (like vLLM's prefix caching, but only within one batch; identical prompts,
        such as a GRPO group's, are already merged by the caller). Each prompt keeps at least one token
        of its own to produce its logits.
        Returns the prefix length C (0 when sharing does not pay).
        """
        C = min(len(p) for p in prompts) - 1
        first = prompts[0]
        for p in prompts[1:]:
            C = next((k for k in range(C) if p[k] != first[k]), C)
        if len(prompts) < 2 or self.min_shared_prefix > C:
            return 0
        dev = model_device(self.model)
        self.model(
            input_ids=torch.tensor([first[:C]], device=dev),
            position_ids=torch.arange(C, device=dev)[None],
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        cache.batch_repeat_interleave(len(prompts))
        return C

    def _outputs(self, prompts, out_ids, out_lp, finish) -> list[GenerateOutput]:
        outs = []
        for p, ids, lp, fin in zip(prompts, out_ids, out_lp, finish, strict=True):
            shown = ids[:-1] if fin == "eos" else ids  # the EOS token is sampled and trained, not shown
            text = self.tokenizer.decode(shown, skip_special_tokens=False)
            outs.append(GenerateOutput(token_ids=ids, logprobs=lp, text=text, finish_reason=fin, prompt_len=len(p)))
        return outs


def _row_hook(batch: list[_Request], loop: asyncio.AbstractEventLoop) -> RowHook:
    """The decode thread's per-token hook: forward the token to its caller's callback on the event
    loop, and stop rows whose caller was cancelled (reading `cancelled()` from a thread is safe)."""

    def hook(row: int, token: int, logprob: float) -> bool:
        request = batch[row]
        if request.future.cancelled():
            return False
        if request.on_token is not None:
            loop.call_soon_threadsafe(request.on_token, token, logprob)
        return True

    return hook


def _sample(
    logits: torch.Tensor, params: SamplingParams, gens: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return ids [b] and their log-probs [b] under logits / temperature."""
    if params.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)  # [b, V]
        tokens = logp.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / params.temperature, dim=-1)  # [b, V]
    probs = logp.exp()
    if params.top_p < 1.0:  # nucleus: keep the smallest prefix of sorted tokens with mass >= top_p
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > params.top_p
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    cdf = probs.cumsum(-1)  # [b, V]
    draws = torch.stack([torch.rand((), generator=g, device="cpu") for g in gens])  # [b] seeded alike on every device
    u = draws.to(cdf.device) * cdf[:, -1]  # [b] one draw per row
    tokens = torch.searchsorted(cdf, u[:, None], right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _hits_stop(tokenizer: PreTrainedTokenizerBase, tail: list[int], stop: tuple[str, ...]) -> bool:
    """True when the decoded tail of a response contains a stop string (checked every token)."""
    text = tokenizer.decode(tail, skip_special_tokens=False)
    return any(s in text for s in stop)


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """EOS ids from both the tokenizer and the generation config (chat models often list several)."""
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (tokenizer.eos_token_id, getattr(gen, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    if not ids:
        raise ValueError("the tokenizer and the model define no EOS token")
    return ids
