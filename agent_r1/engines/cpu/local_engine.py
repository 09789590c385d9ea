"""`LocalEngine`: continuous batching with a torch model in this process, sharing weights with the trainer.

Every `generate` call (one per trajectory turn in the agent loop, one per request in `agent-r1 serve`)
becomes sequences that join the running decode batch at the next step and leave it the step they
finish: iteration-level scheduling (Orca, Yu et al., OSDI 2022; vLLM). Nobody waits for a batch to
drain, and a short answer stops costing decode steps at once.

Each sequence owns a slot of a `SlotCache` (its keys at columns 0..n-1), so sequences of any length
decode together without padding. When a sequence finishes, its slot is *parked* with the tokens it
holds, indexed by block hashes of those tokens. A later prompt that starts with a parked sequence's
tokens - the next turn of the same trajectory, whose prompt is the previous prompt, the sampled
response and the tool result, token for token - takes the slot over and prefills only what the
environment added. This is vLLM's automatic prefix caching and SGLang's RadixAttention (Zheng et al.,
2024) on a slot per sequence. A prompt that only shares a beginning with a parked one (the system
prompt and tool schemas) copies that part of the keys; a context the environment rewrote matches
less, and whatever does not match is prefilled, so it can never be wrong, only slower. Parked slots are
evicted least-recently-used when memory (`kv_cache_gb`) or slots run out, and all of them are
dropped when the weights change (`sync_weights`, `load_weights`) or the trainer puts the engine to
`sleep` for its update. Prompts admitted together that share a beginning of at least
`min_shared_prefix` tokens have it prefilled once, and a GRPO group's identical prompts are
prefilled once and copied.

Each step is one forward pass over the slots (`kv_cache.slot_attention`): a token per decoding row and
chunks of the prompts being prefilled, at most `max_prefill_tokens` prompt tokens a pass, so a
newcomer's prefill rides in the decode steps instead of stalling them (chunked prefill: Agrawal et al.,
"Sarathi-Serve", OSDI 2024), and each run of decoding rows reads keys only up to its own longest row.

Each row samples from its own seeded generator with its own sampling parameters, so a request's
tokens do not depend on which other requests share its batch (up to fp32 rounding differences
between batch shapes). `generate(..., on_token=...)` reports every sampled token as it is decoded
(for streaming), and a caller that is cancelled (a client that disconnected, a request that timed out)
has its row and slot freed at the next step.

Rollouts are reproducible bit for bit, which continuous batching does not give by itself: a row's
logits differ in their last bits with the batch it shares (oneDNN's matmuls depend on the row count,
SDPA on the key width), and which rows share a step would depend on when tool calls return. So the
agent loop makes its trajectories a `cohort`: before it admits new sequences, the engine waits until
every trajectory it answered has sent its next turn or ended (a tool call is short beside a decode
step), and admits them in the order of their seeds. The batches are then a function of the
seeds alone, as a resumed run needs. Requests outside a cohort (serving) are admitted as they come.

A vision-language model's prompts come with their images (`generate(..., images=)`): a prefill embeds
its chunk with the vision tower's features in the placeholders, prompts are compared as keys in which
each placeholder stands for its image's digest (identical placeholders can be different pictures), and
the Qwen2-VL family's positions come from its own `get_rope_index` (docs/vision.md).

The decode loop runs in a worker thread, which lets the event loop run tool calls while the model
decodes. By default weights change only when no sequence is running: `load_weights` stops admitting
new sequences, waits for the running ones to finish, then copies, so every response is sampled from
one version of the weights. `load_weights(..., between_tokens=True)` (asynchronous RL's partial
rollouts) instead pauses decoding at the next token boundary, copies, and lets the running sequences
go on with the new weights over the keys they already hold (PipelineRL's in-flight weight updates,
Piché et al. 2025, arXiv 2509.19128). Every sampled token records the `weights_version` that sampled
it (`GenerateOutput.versions`), so a response that spans an update says which tokens came from which.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import contextvars
import functools
import logging
import random
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from agent_r1.engines.cpu.decode_attention import kernel_for
from agent_r1.engines.cpu.kv_cache import Segment, SlotCache, use_slot_attention
from agent_r1.engines.protocol import GenerateOutput, SamplingParams, TokenCallback, alias_key, full_state_dict
from agent_r1.models.grammar import Grammars, model_grammars
from agent_r1.models.loading import eos_token_ids
from agent_r1.models.onednn import Packs, packed_weights
from agent_r1.models.precision import autocast, model_device
from agent_r1.models.vision import (
    check_images,
    count_placeholders,
    embed_with_images,
    image_token_id,
    placeholder_keys,
    rope_index,
    rope_positions,
)
from agent_r1.types import Image
from agent_r1.utils.malloc import engine_heap
from agent_r1.utils.openmp import release_openmp_workers

log = logging.getLogger(__name__)

RowHook = Callable[[int, int, float], bool]  # (index of the prompt, token id, log-prob) -> keep decoding it
BLOCK = 16  # parked tokens are indexed every BLOCK tokens (shorter matches are not looked up)
COLUMN_STEP = 256  # slot capacity grows in steps of this many tokens
CDF_BLOCK = 512  # tokens a block of the sampler's two-level inverse cdf (`_inverse_cdf`)
COHORT_WAIT_S = 120.0  # longest a decode step waits for a cohort member between turns (then goes on)
# what one more SDPA call costs, in row-columns of keys read (measured on 2 cores: ~23 us a call against
# ~0.12 us per row-column and layer): decoding rows of unlike lengths split where the saved reads pay for it
SEGMENT_COST = 128
KV_MEMORY_SHARE = 0.5  # of the memory free at start-up the KV cache may take (the rest: activations, optimizer)


def kv_budget(kv_cache_gb: float, device: torch.device) -> int:
    """Bytes the KV cache may take: `kv_cache_gb`, but at most `KV_MEMORY_SHARE` of the memory free on the
    device now. The cache grows lazily, so a budget the machine cannot hold (the default 4 GB on a laptop
    with 3 GB free) would be found out only by the OS killing the process, an hour into an eval; capped,
    the engine evicts parked contexts sooner instead. Said once, as a warning."""
    want = int(kv_cache_gb * 2**30)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else free_host_memory()
    most = int(KV_MEMORY_SHARE * free)
    if want > most:
        log.warning(
            f"kv_cache_gb={kv_cache_gb:g} is more than half the {device.type} memory free now "
            f"({free / 2**30:.1f} GiB): the engine keeps at most {most / 2**30:.1f} GiB of keys and values"
        )
    return min(want, most)


def free_host_memory(root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) -> int:
    """Bytes this process may still allocate: the machine's available memory, or less where a cgroup
    limit on this process's cgroup or one above it (a container's `--memory`, a Slurm job's) leaves less;
    the OOM killer acts on the smaller. A cgroup's usage counts its page cache, of which the inactive
    part is reclaimed before any kill, so it is left out, as Kubernetes' working set does."""
    free = psutil.virtual_memory().available
    for limit, used in _cgroup_memory(root, membership):
        free = min(free, max(0, limit - used))
    return free


def _cgroup_memory(root: Path, membership: Path) -> list[tuple[int, int]]:
    """(limit, usage less inactive page cache) of each cgroup from this process's up to the root that
    sets a memory limit: cgroup v2's unified tree (the `0::/path` line) or v1's memory controller."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:  # not Linux
        return []
    found = []
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]  # id:controllers:path
        if not path:
            continue
        if controllers == "":
            base, files = root, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        group = base / path.strip("/")
        for level in [group, *group.parents]:
            try:
                limit = (level / files[0]).read_text().strip()
                if limit != "max":  # v1 writes "no limit" as a huge number, which changes nothing
                    stat = dict(x.split(maxsplit=1) for x in (level / "memory.stat").read_text().splitlines())
                    found.append((int(limit), int((level / files[1]).read_text()) - int(stat.get(files[2], 0))))
            except (OSError, ValueError):  # no limit kept at this level (the root cgroup, another mount)
                pass
            if level == base:
                break
    return found


@dataclass(eq=False)
class _Seq:
    """One prompt being answered: what it asked for, what it sampled, where its keys are."""

    prompt: list[int]
    params: SamplingParams
    seed: int
    gen: torch.Generator
    budget: int  # tokens it may sample (max_new_tokens, cut to the context)
    emit: Callable[[int, float], bool]  # every sampled token; False aborts the row
    done: Callable[[GenerateOutput | BaseException], None]
    cancelled: Callable[[], bool]
    member: _Member | None = None  # the cohort member that asked, if any
    images: list[Image] = field(default_factory=list)  # the images of the prompt's placeholders, in order
    key: list[int] = field(default_factory=list)  # the prompt as compared with others: ids, images by digest
    rope: torch.Tensor | None = None  # [3, P] mrope positions of a prompt with images (Qwen2-VL family)
    delta: int = 0  # position - column of every token after the last image (its sampled tokens)
    out_ids: list[int] = field(default_factory=list)
    out_lp: list[float] = field(default_factory=list)
    out_ver: list[int] = field(default_factory=list)  # the weights_version that sampled each token
    finish: str = "length"
    slot: int = -1
    n: int = 0  # columns of its slot holding keys: tokens the model has seen
    leader: _Seq | None = None  # a GRPO group's first row, prefilled once: this row copies its keys when done
    followers: list[_Seq] = field(default_factory=list)  # the rows that wait for this one's prefill
    matcher: Any = None  # where its grammar is (params.grammar), an xgrammar GrammarMatcher


class Cohort:
    """Callers that take turns with the engine (the agent loop's trajectories): the engine admits new
    sequences only when none of them is between turns, so batches do not depend on timing."""

    def __init__(self, engine: LocalEngine, size: int) -> None:
        self.engine = engine
        self.outside = size  # members answered (or not yet started) that have neither asked again nor left

    def join(self) -> None:
        """Make the calling task a member: its `generate` calls count (one member per asyncio task)."""
        _MEMBER.set(_Member(self))

    def leave(self) -> None:
        """The calling task's member will not ask again (its trajectory ended, however it ended)."""
        member = _MEMBER.get(None)
        if member is None or member.cohort is not self or member.left:
            return
        with self.engine._cond:
            member.left = True
            if not member.inside:
                self.outside -= 1
                self.engine._cond.notify_all()


@dataclass(eq=False)
class _Member:
    cohort: Cohort
    inside: bool = False  # it has a call the engine has not answered
    left: bool = False
    rows: int = 0  # rows of that call still running


_MEMBER: contextvars.ContextVar[_Member | None] = contextvars.ContextVar("agent_r1_cohort_member", default=None)


@dataclass(eq=False)
class _Parked:
    """A finished sequence's keys, kept in its slot for a prompt that continues it."""

    tokens: list[int]  # the tokens whose keys columns 0..len-1 hold (placeholders as image keys)
    slot: int
    keys: list[int]  # block hashes it is indexed under
    stamp: int  # last use (least recently used goes first)


_ENGINES: weakref.WeakSet[LocalEngine] = weakref.WeakSet()  # the live engines, for _stop_decode_threads
_DECODE_THREADS: weakref.WeakSet[threading.Thread] = weakref.WeakSet()  # every decode thread started


@atexit.register
def _stop_decode_threads() -> None:
    """At exit, stop each engine's decode thread between two steps and wait until every one has ended.
    SIGTERM or Ctrl-C mid-rollout (`cli.exit_on_sigterm`) exits while the daemon thread is inside a forward
    pass, and torch torn down under it aborted the process ("terminate called without an active
    exception", exit 134, not 143). A thread that has left its last step is not done either: it still
    leaves its heap and holds the engine (its target), and when that was the engine's last reference
    the thread freed the engine's tensors while the interpreter was being finalized, the same abort
    (1 in ~45 `agent-r1 chat --prompt` runs on a loaded machine). So every decode thread is joined."""
    for engine in list(_ENGINES):
        with engine._cond:
            engine._swapping += 1  # the decode thread leaves at the next token boundary (_work)
    for thread in list(_DECODE_THREADS):
        thread.join(timeout=60)


class LocalEngine:
    """Continuously batched, KV-cached sampling from a Hugging Face causal LM in this process."""

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
        kv_cache_gb: float = 4.0,
        max_prefill_tokens: int = 2048,
        pack_weights: bool = False,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be at least 1, got {max_prefill_tokens}")
        if kv_cache_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(f"kv_cache_dtype must be None, torch.float32 or torch.bfloat16, got {kv_cache_dtype}")
        use_slot_attention(model)  # packed passes attend per sequence over the slots (kv_cache.py)
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        text_config = model.config.get_text_config()
        self.max_context = max_context or int(getattr(text_config, "max_position_embeddings", 2048))
        self.image_token_id = image_token_id(model)  # None for a text-only model
        self._rope_index = rope_index(model)  # Qwen2-VL's get_rope_index: positions are not columns
        self.batch_wait_s = batch_wait_s  # an idle engine waits this long for concurrent callers to arrive
        self.min_shared_prefix = min_shared_prefix  # shorter common prefixes are not worth a separate pass
        self.kv_cache_bytes = kv_budget(kv_cache_gb, model_device(model))  # slots (running and parked) never take more
        self.max_prefill_tokens = max_prefill_tokens  # prompt tokens one forward pass computes beside its decode rows
        self.eos_ids = eos_token_ids(model, tokenizer)
        self._seeds = random.Random(seed)
        self.weights_version = 0  # bumped by every load_weights
        # prompt tokens computed / whose keys were already held, decode steps and the tokens they fed,
        # seconds in passes that only prefill / only decode, rows whose caller went away, decode steps
        # that also prefilled and their seconds
        self.stats = {
            "prefilled": 0, "reused": 0, "decode_steps": 0, "decoded": 0, "prefill_s": 0.0, "decode_s": 0.0,
            "aborted": 0, "mixed_steps": 0, "mixed_s": 0.0,
        }  # fmt: skip
        # shared with callers' threads, under _cond
        self._cond = threading.Condition()
        self._waiting: list[_Seq] = []
        self._paused = 0  # > 0 while a weight update waits for the running sequences to finish
        self._swapping = 0  # > 0 while a weight update waits for the next token boundary
        self._thread: threading.Thread | None = None
        self._cohort: Cohort | None = None
        # the decode thread's own, under _weights_lock (held while any sequence runs)
        self._weights_lock = threading.Lock()
        self._cache: SlotCache | None = None
        self._slot: list[_Seq | _Parked | None] = []  # owner of each slot: running [0, b), parked [b, b+p)
        self._running: list[_Seq] = []  # slot order
        self._parked: list[_Parked] = []  # any order
        self._index: dict[int, _Parked] = {}  # block hash of a token prefix -> a parked entry holding it
        self._clock = 0
        # the weights in oneDNN's layout, kept until the KV memory is freed; None: products read the plain
        # weights (the default: the copies are as large as the weights, and took the demo over 4 GB)
        self._packs: Packs | None = {} if pack_weights else None
        # keys and values stored in bf16 (None: the model's dtype): half the KV memory and half the bytes
        # a decode step's attention reads, but sampled log-probs no longer match the trainer's forward
        # to fp32 rounding: for serving and eval, not the trainer's own rollouts
        self.kv_cache_dtype = kv_cache_dtype
        _ENGINES.add(self)

    # --- callers --------------------------------------------------------------------------------

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        on_token: TokenCallback | None = None,
        *,
        images: list[list[Image]] | None = None,
    ) -> list[GenerateOutput]:
        """Sample one response per prompt; the prompts join the running batch at its next step.

        `on_token(i, token_id, logprob)` is called on this event loop for every token sampled for
        prompt i, in order, before `generate` returns. Cancelling the call frees its rows. `images[i]`
        are the images of prompt i's placeholders, in order (a vision-language model).
        """
        loop = asyncio.get_running_loop()
        base = params.seed if params.seed is not None else self._seeds.getrandbits(62)
        futures = [loop.create_future() for _ in prompts]
        seqs = [
            self._new_seq(
                p,
                params,
                base + i,
                _forward_tokens(loop, f, on_token and functools.partial(on_token, i)),
                functools.partial(_resolve_threadsafe, loop, f),
                f.cancelled,
                images[i] if images else [],
            )
            for i, (p, f) in enumerate(zip(prompts, futures, strict=True))
        ]
        self._submit(seqs)
        return list(await asyncio.gather(*futures))

    def generate_batch(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        on_token: RowHook | None = None,
        *,
        images: list[list[Image]] | None = None,
    ) -> list[GenerateOutput]:
        """Synchronously sample one response per prompt, seeded per prompt (for callers without an event
        loop). `on_token(i, token, logprob)` sees every sampled token; returning False aborts that row
        (finish_reason "abort")."""
        results: list[GenerateOutput | BaseException | None] = [None] * len(prompts)
        left = [len(prompts)]
        finished = threading.Event()

        def done(i: int, out: GenerateOutput | BaseException) -> None:
            results[i] = out
            left[0] -= 1  # only the decode thread calls this
            if left[0] == 0:
                finished.set()

        def emit(i: int, token: int, logprob: float) -> bool:
            return on_token is None or on_token(i, token, logprob)

        seqs = [
            self._new_seq(
                p,
                params,
                s,
                functools.partial(emit, i),
                functools.partial(done, i),
                lambda: False,
                images[i] if images else [],
            )
            for i, (p, s) in enumerate(zip(prompts, seeds, strict=True))
        ]
        if seqs:
            self._submit(seqs)
            finished.wait()
        if error := next((r for r in results if isinstance(r, BaseException)), None):
            raise error
        return results  # type: ignore[return-value]

    @contextlib.contextmanager
    def cohort(self, size: int) -> Iterator[Cohort]:
        """`size` callers that will each `join()` in their own task, ask in turns and `leave()` at the
        end: their sequences are batched deterministically (see the module docstring)."""
        cohort = Cohort(self, size)
        with self._cond:
            self._cohort = cohort
        try:
            yield cohort
        finally:
            with self._cond:
                self._cohort = None
                self._cond.notify_all()

    @property
    def idle(self) -> bool:
        """No sequence waiting or running (the decode thread has exited)."""
        with self._cond:
            return self._thread is None

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until no sequence is waiting or running and the decode thread has left its loop (cancelled
        rows are freed at its next step). Returns whether the engine went idle. (At exit the thread is
        also joined, `_stop_decode_threads`.)"""
        deadline = time.monotonic() + timeout
        while not self.idle and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.idle

    def sync_weights(self, model: torch.nn.Module, version: int | None = None, between_tokens: bool = False) -> None:
        """Sample from `model`'s current weights. When it is the engine's own model (the trainer and the
        engine share one object) there is nothing to copy, but the kept keys were computed with the
        old weights and are dropped; otherwise its weights (LoRA merged) are copied in."""
        if model is not self.model:
            self.load_weights(full_state_dict(model), version, between_tokens)
            return
        self.sleep()
        self.weights_version = self.weights_version + 1 if version is None else version

    def close(self) -> None:
        """Finish what runs, then free the KV memory and the packed weights (the model is the caller's)."""
        self.wait_idle()
        self.sleep()

    def sleep(self) -> None:
        """Free the KV memory and the packed weights (running sequences finish first): the trainer's
        update needs the memory, and the kept keys are stale after it anyway. The next request allocates again."""
        with self._paused_engine():
            self._release()

    def load_weights(
        self, tensors: Mapping[str, torch.Tensor], version: int | None = None, between_tokens: bool = False
    ) -> int:
        """Copy `tensors` into the model's weights in place, once no sequence is running (or, with
        `between_tokens`, at the next token boundary: running sequences go on with the new weights);
        returns their number.

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
        with self._paused_engine(drain=not between_tokens), torch.no_grad():
            for name, t in tensors.items():
                target[name].copy_(t)
            self._drop_parked()
            self.weights_version = self.weights_version + 1 if version is None else version
        return len(tensors)

    def _new_seq(self, prompt, params, seed, emit, done, cancelled, images=()) -> _Seq:
        if len(prompt) == 0:
            raise ValueError("cannot generate from an empty prompt")
        check_images(prompt, images, self.image_token_id)  # a text-only model, a prompt and images that disagree
        gen = torch.Generator(device="cpu").manual_seed(seed)
        budget = min(params.max_new_tokens, self.max_context - len(prompt))
        key = placeholder_keys(prompt, images, self.image_token_id)
        s = _Seq(list(prompt), params, seed, gen, budget, emit, done, cancelled, images=list(images), key=key)
        if params.grammar is not None:  # a grammar that does not compile fails the call, before it queues
            s.matcher = self._grammars().matcher(params.grammar)
        if images and self._rope_index is not None:  # positions from the model's own function
            s.rope = rope_positions(self._rope_index, prompt, images, self.image_token_id)  # [3, P]
            s.delta = int(s.rope.max()) + 1 - len(prompt)
        return s

    def _submit(self, seqs: list[_Seq]) -> None:
        """Queue sequences for the decode thread (started when idle); a prompt that fills the context
        has nothing to sample and is answered at once. The calling thread, which now waits, hands back its
        OpenMP workers: while they exist every decode step's parallel regions wait on sleeping workers
        (`utils/openmp.py`: decode 20-30% slower after the trainer had run on this thread)."""
        release_openmp_workers()
        member = _MEMBER.get(None)
        if member is not None and member.cohort is self._cohort and seqs:
            with self._cond:
                if not member.inside:
                    member.cohort.outside -= 1
                member.inside, member.rows = True, len(seqs)
                for s in seqs:
                    s.member = member
                self._cond.notify_all()
        for s in [s for s in seqs if s.budget <= 0]:
            self._answered(s)
            s.done(self._output(s))
        with self._cond:
            self._waiting.extend(s for s in seqs if s.budget > 0)
            self._start_worker()

    @contextlib.contextmanager
    def _paused_engine(self, drain: bool = True) -> Iterator[None]:
        """Hold new sequences back and wait until none is running (`drain`: for freeing memory, and weight
        updates that keep each response on one version), or only until the current decode step ends."""
        with self._cond:
            if drain:
                self._paused += 1
            else:
                self._swapping += 1
        try:
            with self._weights_lock:  # the decode thread holds it while it steps
                yield
        finally:
            with self._cond:
                if drain:
                    self._paused -= 1
                else:
                    self._swapping -= 1
                self._start_worker()

    def _start_worker(self) -> None:
        """Start the decode thread if there is work and none runs (the caller holds `_cond`)."""
        busy = self._waiting or self._running  # running: sequences a between-token pause left mid-answer
        if self._thread is None and busy and not self._paused and not self._swapping:
            self._thread = threading.Thread(target=self._work, name="agent-r1-decode", daemon=True)
            _DECODE_THREADS.add(self._thread)
            self._thread.start()

    # --- the decode thread ----------------------------------------------------------------------

    def _work(self) -> None:
        """Run decode steps while there are sequences; exit when idle (a new request starts it again).
        Its passes' tensors come from a heap kept for it (`engine_heap`: no page faults on every pass), and
        with `pack_weights` its products read weights kept in oneDNN's layout (`packed_weights`: not
        reordered on every pass; 13% less decode time at 64 rows, at the weights' size in memory)."""
        time.sleep(self.batch_wait_s)  # let the other trajectories of a turn arrive and prefill together
        packs = packed_weights(self._packs) if self._packs is not None else contextlib.nullcontext()
        with engine_heap(), packs:
            while True:
                with self._cond:
                    # a drain lets the running sequences finish first; a between-token pause stops here
                    if self._swapping or not (self._waiting or self._running) or (self._paused and not self._running):
                        self._thread = None
                        return
                with self._weights_lock, autocast(self.model), torch.inference_mode():
                    self._step()
                    while self._running and not self._swapping:
                        self._step()

    def _step(self) -> None:
        """One forward pass: newcomers take slots, every decoding row feeds its last token and the rows
        being prefilled their next chunk (at most `max_prefill_tokens` prompt tokens a pass), the rows
        that got logits sample, and finished rows leave."""
        new = self._take_waiting()
        try:
            if new:
                self._admit(new)
            if not self._running:  # every caller gave up before its turn
                return
            rows, logits = self._pass()
        except Exception as exc:  # a failed forward pass: fail its rows, keep serving the rest
            self._fail_all(exc, list(dict.fromkeys(self._running + new)))
            return
        if rows:
            self._sample(rows, logits)

    def _pass(self) -> tuple[list[_Seq], torch.Tensor]:
        """Decode and prefill in one packed forward pass (chunked prefill: a newcomer's prompt rides in
        the decode steps instead of stalling them); returns the rows that sample and their logits
        [r, V]. A GRPO group's other rows copy their leader's keys when its prompt is done."""
        ready = [s for s in self._running if s.out_ids]  # slot order
        chunks, budget = [], self.max_prefill_tokens
        for s in self._running:
            if not s.out_ids and s.leader is None and budget > 0:
                k = min(len(s.prompt) - s.n, budget)
                chunks.append((s, k))
                budget -= k
        logits = self._forward(ready, chunks)  # [r, V]: the ready rows, then the prompts just completed
        rows, index = list(ready), list(range(len(ready)))
        for i, s in enumerate(s for s, _ in chunks if s.n == len(s.prompt)):
            for f in s.followers:
                self._slots().move(s.slot, f.slot, len(f.prompt))
                f.n, f.leader = len(f.prompt), None
            rows += [s, *s.followers]  # the followers sample from their leader's logits
            index += [len(ready) + i] * (1 + len(s.followers))
            s.followers = []
        if not rows or index == list(range(len(logits))):  # each row its own logits: no copy of [r, V]
            return rows, logits
        return rows, logits[torch.tensor(index, device=logits.device)]

    def _take_waiting(self) -> list[_Seq]:
        """Sequences that join now: as many as the batch size and the KV budget allow (at least one when
        nothing runs, so a long prompt is never starved)."""
        with self._cond:
            cohort = self._cohort
            if cohort is not None:  # every member in the engine or gone: the batch is a function of seeds
                self._cond.wait_for(lambda: self._cohort is not cohort or cohort.outside <= 0, COHORT_WAIT_S)
                self._waiting.sort(key=lambda s: s.seed)
            if self._paused:
                return []
            self._waiting = [s for s in self._waiting if not s.cancelled()]  # callers that gave up
            b, taken = len(self._running), 0
            cols = max((len(s.prompt) + s.budget for s in self._running), default=0)
            per_token = self._slots().bytes_per_token()
            while taken < len(self._waiting) and b + taken < self.max_batch_size:
                s = self._waiting[taken]
                need = max(cols, len(s.prompt) + s.budget)
                if b + taken and (b + taken + 2) * _round_up(need) * per_token > self.kv_cache_bytes:
                    break
                taken, cols = taken + 1, need
            new, self._waiting = self._waiting[:taken], self._waiting[taken:]
            return new

    def _slots(self) -> SlotCache:
        if self._cache is None:
            cfg = self.model.config.get_text_config()
            heads = cfg.num_attention_heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
            self._cache = SlotCache(
                cfg.num_hidden_layers, kv_heads, head_dim, model_device(self.model), self.kv_cache_dtype
            )
        return self._cache

    # --- slots ----------------------------------------------------------------------------------

    def _fit(self, slots: int, columns: int, keep: set[_Parked] = frozenset()) -> None:
        """Room for `slots` new or running slots plus the parked ones, `columns` long, in the KV budget:
        evicts parked slots (least recently used first, never those in `keep`) until it fits, then
        grows the buffer."""
        cache = self._slots()
        cap = max(cache.capacity, _round_up(columns))
        per_slot = cap * cache.bytes_per_token()
        # parked keys live in slots the running batch leaves free: the buffer never grows for them
        most = max(slots, min(self.kv_cache_bytes // per_slot, self.max_batch_size + 1))
        while (evictable := [e for e in self._parked if e not in keep]) and slots + len(self._parked) > most:
            self._evict(min(evictable, key=lambda e: e.stamp))
        need = slots + len(self._parked)
        if need <= cache.slots and cap <= cache.capacity:
            return
        cache.reserve(max(need, min(2 * cache.slots, most)), cap)
        self._slot = (self._slot + [None] * cache.slots)[: cache.slots]

    def _place(self, owner: _Seq | _Parked, slot: int) -> None:
        self._slot[slot] = owner
        owner.slot = slot

    def _move(self, owner: _Seq | _Parked, slot: int) -> None:
        """Move an owner's keys to a free slot."""
        self._slots().move(owner.slot, slot, _held(owner))
        self._slot[owner.slot] = None
        self._place(owner, slot)

    def _swap(self, a: int, b: int) -> None:
        x, y = self._slot[a], self._slot[b]
        self._slots().swap(a, b, _held(x), _held(y))
        self._place(x, b)
        self._place(y, a)

    def _open_running_slot(self) -> int:
        """A free slot at the end of the running region (the first parked slot moves out of the way).
        `_fit` made room for it, as it counted the slots ahead; a prompt that meant to take a parked
        sequence over but copies it instead (the shared prefix parked meanwhile is a longer match) needs
        one more, and the buffer grows by it."""
        b, p = len(self._running), len(self._parked)
        cache = self._slots()
        if b + p >= cache.slots:
            cache.reserve(b + p + 1, cache.capacity)
            self._slot += [None] * (cache.slots - len(self._slot))
        if p:
            self._move(self._slot[b], b + p)
        return b

    def _close_running_slot(self, s: _Seq) -> int:
        """Take `s` out of the running region (the last running row fills its place); returns the freed
        slot, which is the one just before the parked region."""
        last = self._running[-1]
        if last is not s:
            self._swap(s.slot, last.slot)
            i = self._running.index(s)
            self._running[i] = last
        self._running.pop()
        return s.slot

    def _park(self, s: _Seq) -> None:
        """Keep a finished sequence's keys for a prompt that continues it (or free its slot)."""
        slot = self._close_running_slot(s)
        tokens = (s.key + s.out_ids)[: s.n]
        if s.finish == "abort" or len(tokens) < BLOCK:  # a disconnected client: free its memory now
            self._slot[slot] = None
            if self._parked:  # keep the parked region contiguous
                self._move(self._slot[slot + len(self._parked)], slot)
            return
        self._clock += 1
        entry = _Parked(tokens, slot, _block_keys(tokens), self._clock)
        self._slot[slot] = entry
        self._parked.append(entry)
        for k in entry.keys:
            self._index[k] = entry

    def _unindex(self, entry: _Parked) -> None:
        """Forget `entry`'s keys. A block key it shares with other parked entries (the system prompt of
        every conversation) points to the newest of them instead: deleting it would hide their keys from
        every later lookup, since `_lookup` stops at the first missing block."""
        self._parked.remove(entry)
        lost = {k for k in entry.keys if self._index.get(k) is entry}
        for k in lost:
            del self._index[k]
        for e in sorted(self._parked, key=lambda e: e.stamp):  # the newest holder is written last
            for k in e.keys:
                if k in lost:
                    self._index[k] = e

    def _evict(self, entry: _Parked) -> None:
        """Forget a parked entry; the last parked slot fills its place."""
        self._unindex(entry)
        last = len(self._running) + len(self._parked)  # the old last parked slot
        self._slot[entry.slot] = None
        if entry.slot != last:
            self._move(self._slot[last], entry.slot)

    def _drop_parked(self) -> None:
        for e in self._parked:
            self._slot[e.slot] = None
        self._parked, self._index = [], {}

    def _lookup(self, tokens: list[int], limit: int) -> tuple[_Parked | None, int]:
        """The parked entry sharing the longest prefix with `tokens` (whole blocks, then token by token),
        and the length m <= limit of that prefix."""
        entry = None
        for k in _block_keys(tokens[: limit - limit % BLOCK]):
            if k not in self._index:
                break
            entry = self._index[k]
        if entry is None:
            return None, 0
        m = min(len(entry.tokens), limit)
        m = next((i for i in range(m) if entry.tokens[i] != tokens[i]), m)
        return (entry, m) if m >= BLOCK else (None, 0)

    # --- forward passes -------------------------------------------------------------------------

    def _admit(self, new: list[_Seq]) -> None:
        """Give the new sequences running slots, with whatever keys parked slots already hold; the rest of
        each prompt is prefilled by the next passes. A GRPO group's identical prompts are prefilled once
        (the first) and copied (the others, when it is done)."""
        groups: dict[tuple[int, ...], list[_Seq]] = {}
        for s in new:
            groups.setdefault(tuple(s.key), []).append(s)
        firsts = [g[0] for g in groups.values()]
        hits = [self._lookup(s.key, len(s.key) - 1) for s in firsts]
        whole = Counter(id(e) for e, m in hits if e is not None and m == len(e.tokens))
        # an entry several prompts continue whole (a parked shared prefix) is copied, not taken over
        continued = {e for e, m in hits if e is not None and m == len(e.tokens) and whole[id(e)] == 1}
        # rows that take a parked slot over need no new one, and their slots must not be evicted for them
        slots = len(self._running) + len(new) - len(continued) + 1  # + 1 for a shared prefix
        self._fit(slots, max(len(s.prompt) + s.budget for s in new), keep=continued)
        self._prefill_shared_prefix(firsts)
        # look again: making room may have evicted a partial match, the shared prefix may be new
        found = [self._lookup(s.key, len(s.key) - 1) for s in firsts]
        claims = Counter(id(e) for e, m in found if e is not None and m == len(e.tokens))
        for group, (entry, m) in zip(groups.values(), found, strict=True):
            s = group[0]
            if entry is not None and claims[id(entry)] == 1 and m == len(entry.tokens):
                self._take_over(entry, s)  # it continues a parked sequence (the last prompt that does)
            else:
                self._place(s, self._open_running_slot())
                if entry is not None:  # a shared beginning: copy those keys
                    claims[id(entry)] -= m == len(entry.tokens)
                    self._slots().move(entry.slot, s.slot, m)
                    self._clock += 1
                    entry.stamp = self._clock
            s.n = m
            self.stats["reused"] += m
            self._running.append(s)
            for f in group[1:]:
                self._place(f, self._open_running_slot())
                f.leader = s
                s.followers.append(f)
                self._running.append(f)

    def _take_over(self, entry: _Parked, s: _Seq) -> None:
        """`s` gets `entry`'s slot, keys and all, as the next running slot."""
        self._unindex(entry)
        b = len(self._running)
        if entry.slot != b:
            self._swap(entry.slot, b)
        self._place(s, b)

    def _prefill_shared_prefix(self, seqs: list[_Seq]) -> None:
        """Prefill the prefix all new prompts share once and park it, so each prompt copies its keys.

        Agent prompts repeat a long system prompt, tool schemas and few-shot examples. Skipped when it
        is shorter than `min_shared_prefix` or already parked. Each prompt keeps at least one token of
        its own to produce its logits.
        """
        if len(seqs) < 2:
            return
        first, C = seqs[0].key, min(len(s.key) for s in seqs) - 1
        for s in seqs[1:]:
            C = next((k for k in range(C) if s.key[k] != first[k]), C)
        entry, m = self._lookup(first, C)
        if min(C, C - m) < self.min_shared_prefix:
            return
        job = _Seq(seqs[0].prompt[:C], SamplingParams(), 0, None, 0, None, None, None)  # type: ignore[arg-type]
        job.images, job.key = seqs[0].images, first[:C]  # a cut inside an image takes its first features
        job.rope = seqs[0].rope[:, :C] if seqs[0].rope is not None else None
        self._place(job, self._open_running_slot())
        if entry is not None:
            self._slots().move(entry.slot, job.slot, m)
        job.n = m
        self.stats["reused"] += m
        self._running.append(job)
        self._forward([], [(job, C - m)])
        self._park(job)

    def _forward(self, rows: list[_Seq], chunks: list[tuple[_Seq, int]]) -> torch.Tensor:
        """One packed forward pass `[1, T]`: each of `rows` (slot order) feeds its last sampled token at
        its own column, each chunk (s, k) the next k tokens of s's prompt. Attention runs per segment over
        the slots (`kv_cache.slot_attention`). Returns the next-token logits [r, V] of the rows, then of
        the chunks that complete their prompt."""
        dev, cache = model_device(self.model), self._slots()
        ids = [s.out_ids[-1] for s in rows]
        slots = [s.slot for s in rows]
        cols = [s.n for s in rows]
        pos = [s.n + s.delta for s in rows]  # mrope: moved by the images before it (the same in all 3 dims)
        for s, k in chunks:
            ids += s.prompt[s.n : s.n + k]
            slots += [s.slot] * k
            cols += range(s.n, s.n + k)
            pos += range(s.n, s.n + k)
        width = max(c + 1 for c in cols)
        self._fit(len(self._running), width)
        col_t = torch.tensor(cols, device=dev)  # [T]
        keep, t = list(range(len(rows))), len(rows)  # the tokens whose logits are needed
        for s, k in chunks:
            t += k
            if s.n + k == len(s.prompt):
                keep.append(t - 1)
        # every token of the pass in one call of the kernel, each reading its own columns: a decoding row's, and
        # a prompt chunk's token those up to its own (causal, in tiles of 16 tokens), at 1.2-4x SDPA's speed
        # (docs/log/measurements.md). The kernel takes fp32 queries (a bf16 model, or bf16 autocast, attends through
        # SDPA, which rounds as the trainer's does)
        fp32 = self.model.dtype == torch.float32 and not torch.is_autocast_enabled(dev.type)
        if fp32 and kernel_for(cache.dtype, cache.device) is not None:
            segments = [Segment(0, len(cols), slots[0], True, col_t, width, min(cols), torch.tensor(slots, device=dev))]
        else:  # SDPA: runs of rows in consecutive slots, each read up to its longest row, then a call a chunk
            segments = [
                Segment(i, j - i, rows[i].slot, True, col_t[i:j], max(cols[i:j]) + 1, min(cols[i:j]))
                for i, j in _row_runs(rows)
            ]
            t = len(rows)
            for s, k in chunks:
                segments.append(Segment(t, k, s.slot, False, col_t[t : t + k], s.n + k, s.n))
                t += k
        position_ids = torch.tensor(pos, device=dev)[None]  # [1, T]
        if any(s.rope is not None for s, _ in chunks):  # [3, 1, T] mrope positions of a prompt with images
            position_ids = position_ids[None].repeat(3, 1, 1)
            t = len(rows)
            for s, k in chunks:
                if s.rope is not None:
                    position_ids[:, 0, t : t + k] = s.rope[:, s.n : s.n + k].to(dev)
                t += k
        ids_t = torch.tensor(ids, device=dev)  # [T]
        inputs = {"input_ids": ids_t[None]}
        if any(s.images for s, _ in chunks):  # the vision tower's features in the placeholders of the chunks
            embeds, t = self.model.get_input_embeddings()(ids_t), len(rows)  # [T, H]
            for s, k in chunks:
                if s.images:
                    skip = count_placeholders(s.prompt[: s.n], self.image_token_id)
                    piece = ids_t[t : t + k]
                    embeds[t : t + k] = embed_with_images(self.model, piece, s.images, self.image_token_id, skip)
                t += k
            inputs = {"inputs_embeds": embeds[None]}  # [1, T, H]
        start = time.perf_counter()
        with cache.packed(torch.tensor(slots, device=dev), col_t, segments):
            out = self.model(
                **inputs,
                position_ids=position_ids,
                attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=dev),  # unused: slot attention masks
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=torch.tensor(keep or [0], device=dev),
            )
        self.stats["mixed_s" if rows and chunks else "decode_s" if rows else "prefill_s"] += time.perf_counter() - start
        for s in rows:
            s.n += 1
        for s, k in chunks:
            s.n += k
            self.stats["prefilled"] += k
        if rows:
            self.stats["decode_steps"] += 1
            self.stats["decoded"] += len(rows)
            self.stats["mixed_steps"] += bool(chunks)
        return out.logits[0, : len(keep)]  # [r, V]

    # --- sampling and finishing -----------------------------------------------------------------

    def _sample(self, rows: list[_Seq], logits: torch.Tensor) -> None:
        """Sample each row's next token, report it, and let finished rows leave the batch."""
        logits = logits.float()  # [b, V]
        constrained = {i: s.matcher for i, s in enumerate(rows) if s.matcher is not None}
        if constrained:  # what each row's grammar does not allow next gets -inf
            self._grammars().apply(logits, constrained)
        tokens, logprobs = _sample(logits, [s.params for s in rows], [s.gen for s in rows])
        finished = []
        for s, tok, lp in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):  # one copy to the host
            s.out_ids.append(tok)
            s.out_lp.append(lp)
            s.out_ver.append(self.weights_version)
            stop = s.params.stop
            if not s.emit(tok, lp):
                s.finish = "abort"
                self.stats["aborted"] += 1
            elif tok in self.eos_ids:
                s.finish = "eos"
            elif stop and _hits_stop(self.tokenizer, s.out_ids[-(max(map(len, stop)) + 2) :], stop):
                s.finish = "stop"
            elif s.matcher is not None and (not s.matcher.accept_token(tok) or s.matcher.is_terminated()):
                s.finish = "stop"  # the grammar is finished (with no stop token to end it)
            elif len(s.out_ids) < s.budget:
                continue
            finished.append(s)
        for s in sorted(finished, key=lambda s: -s.slot):  # from the back: each leaves a compact batch
            self._park(s)
            self._answered(s)
            s.done(self._output(s))

    def _grammars(self) -> Grammars:
        """The compiled grammars for this model's tokenizer and logits (built at the first grammar)."""
        return model_grammars(self.model, self.tokenizer)

    def _answered(self, s: _Seq) -> None:
        """A cohort member whose rows have all finished is between turns until it asks again or leaves."""
        m = s.member
        if m is None:
            return
        with self._cond:
            m.rows -= 1
            if m.rows == 0 and m.inside:
                m.inside = False
                if not m.left:
                    m.cohort.outside += 1

    def _fail_all(self, exc: Exception, seqs: list[_Seq]) -> None:
        """A forward pass failed: every sequence in it gets the error; the engine starts clean."""
        for s in seqs:
            if s.done is not None:  # (not a shared prefix being prefilled)
                self._answered(s)
                s.done(exc)
        self._release()

    def _release(self) -> None:
        """No running or parked sequences, no KV memory, no packed weights."""
        self._drop_parked()
        if self._packs is not None:
            self._packs.clear()
        self._running, self._slot = [], []
        if self._cache is not None:
            self._cache.release()

    def _output(self, s: _Seq) -> GenerateOutput:
        shown = s.out_ids[:-1] if s.finish == "eos" else s.out_ids  # the EOS token is sampled and trained, not shown
        text = self.tokenizer.decode(shown, skip_special_tokens=False)
        return GenerateOutput(s.out_ids, s.out_lp, text, s.finish, len(s.prompt), s.out_ver)


def _held(owner: _Seq | _Parked | None) -> int:
    """Columns of keys an owner's slot holds."""
    if owner is None:
        return 0
    return len(owner.tokens) if isinstance(owner, _Parked) else owner.n


def _row_runs(rows: list[_Seq]) -> list[tuple[int, int]]:
    """Split decoding rows (slot order) into runs [i, j) that attend in one SDPA call, each reading its
    slots up to its longest row: runs of consecutive slots, cut where the columns the shorter rows would
    read for nothing cost more than another call (`SEGMENT_COST`; dynamic programming over the cuts)."""
    runs, start = [], 0
    for i in range(1, len(rows) + 1):
        if i < len(rows) and rows[i].slot == rows[i - 1].slot + 1:
            continue
        w = [s.n + 1 for s in rows[start:i]]  # columns each row reads
        best, cut = [0] + [0] * len(w), [0] * (len(w) + 1)
        for j in range(1, len(w) + 1):
            widest, best[j] = 0, None
            for a in range(j - 1, -1, -1):
                widest = max(widest, w[a])
                c = best[a] + (j - a) * widest + SEGMENT_COST
                if best[j] is None or c < best[j]:
                    best[j], cut[j] = c, a
        j, found = len(w), []
        while j:
            found.append((start + cut[j], start + j))
            j = cut[j]
        runs += reversed(found)
        start = i
    return runs


def _round_up(columns: int) -> int:
    return -(-max(columns, 1) // COLUMN_STEP) * COLUMN_STEP


def _block_keys(tokens: list[int]) -> list[int]:
    """A chained hash of every whole block of tokens: key i stands for tokens[:BLOCK * (i + 1)]."""
    keys, h = [], 0
    for i in range(BLOCK, len(tokens) + 1, BLOCK):
        h = hash((h, *tokens[i - BLOCK : i]))
        keys.append(h)
    return keys


def _forward_tokens(loop: asyncio.AbstractEventLoop, future: asyncio.Future, on_token) -> Callable[[int, float], bool]:
    """The decode thread's per-token hook for an async caller: forward the token to its callback on the
    caller's event loop; False (abort the row) once the caller was cancelled (reading `cancelled()`
    from a thread is safe)."""

    def emit(token: int, logprob: float) -> bool:
        if future.cancelled():
            return False
        if on_token is not None:
            _call_threadsafe(loop, on_token, token, logprob)
        return True

    return emit


def _resolve_threadsafe(loop: asyncio.AbstractEventLoop, future: asyncio.Future, out) -> None:
    def resolve() -> None:
        if future.done():
            return
        if isinstance(out, BaseException):
            future.set_exception(out)
        else:
            future.set_result(out)

    _call_threadsafe(loop, resolve)


def _call_threadsafe(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """Run `fn(*args)` on `loop`, unless the loop has closed: a caller whose loop is gone (a finished
    rollout) no longer needs its answer."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _sample(
    logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row, each with its own temperature and top-p; return ids [b] and their
    log-probs [b] under logits / temperature (temperature 1 for greedy rows).

    The log-prob is z - logsumexp(z), as the trainer computes it (torch's fp32 log_softmax kernel on AVX-512
    CPUs is ~10x less exact: 1e-5 over a 49k vocabulary against 1e-6, which alone broke the 1e-4 drift
    check). logsumexp is computed here as torch does it (max, exp of the difference, sum, log), so its
    exponentials serve as the sampled rows' unnormalised probabilities: ~4 passes over the [b, V] logits
    a decode step, not ~9 (25 ms a step at 64 rows of SmolLM2's vocabulary)."""
    temperature = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)  # [b]
    z = logits if all(p.temperature in (0, 1) for p in params) else logits / temperature[:, None]  # [b, V]
    m = z.amax(dim=-1, keepdim=True)  # [b, 1]
    e = (z - m).exp_()  # [b, V] exp(z - max)
    lse = e.sum(dim=-1, keepdim=True).log_().add_(m)  # [b, 1] = torch.logsumexp(z), op for op
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    sampled = [i for i, p in enumerate(params) if p.temperature > 0]
    tokens = torch.zeros(len(params), dtype=torch.long, device=logits.device)
    if greedy:
        g = torch.tensor(greedy, device=logits.device)
        tokens[g] = z[g].argmax(dim=-1)
    if sampled:
        idx = torch.tensor(sampled, device=logits.device)
        probs = e if len(sampled) == len(params) else e[idx]  # [s, V] unnormalised: exp(z - max)
        top_p = torch.tensor([params[i].top_p for i in sampled], device=logits.device)[:, None]  # [s, 1]
        if (top_p < 1).any():  # nucleus: keep the smallest prefix of sorted tokens with mass >= top_p
            probs = probs / probs.sum(-1, keepdim=True)
            sorted_p, order = probs.sort(dim=-1, descending=True)
            drop = (sorted_p.cumsum(-1) - sorted_p > top_p) & (top_p < 1)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        draws = torch.stack([torch.rand((), generator=gens[i], device="cpu") for i in sampled])  # [s]
        tokens[idx] = _inverse_cdf(probs, draws.to(probs.device))  # one draw per row, seeded alike on every device
    return tokens, (z.gather(-1, tokens[:, None]) - lse).squeeze(-1)


def _inverse_cdf(probs: torch.Tensor, draws: torch.Tensor, block: int = CDF_BLOCK) -> torch.Tensor:
    """The token each row's draw picks by inverse transform sampling: the first whose cumulative mass
    exceeds draw x total, from probs [s, V] (unnormalised, >= 0) and draws [s] in [0, 1).

    In two levels, because a cumulative sum is a chain of dependent additions (~1.5 ns an element here: 4.6
    ms a decode step at 64 rows of a 49k vocabulary): sums of blocks of `block` tokens (vectorised), the
    block whose running total passes the draw, then the running total within that block alone. The
    same choice as one cumsum over the row but at rounding boundaries; a token of zero mass is never picked."""
    s, v = probs.shape
    whole = v // block * block
    sums = probs[:, :whole].view(s, whole // block, block).sum(-1)  # [s, v // block]
    if whole < v:
        sums = torch.cat([sums, probs[:, whole:].sum(-1, keepdim=True)], -1)  # [s, blocks] the tail's block
    totals = sums.cumsum(-1)  # [s, blocks]
    u = draws * totals[:, -1]
    u = torch.minimum(u, torch.nextafter(totals[:, -1], torch.zeros_like(u)))[:, None]  # [s, 1] below the total
    b = torch.searchsorted(totals, u, right=True).clamp_(max=totals.shape[1] - 1)  # [s, 1] the block passing u
    cols = b * block + torch.arange(block, device=probs.device)  # [s, block]
    inside = probs.gather(-1, cols.clamp(max=v - 1)) * (cols < v)  # [s, block] its tokens' mass
    before = torch.where(b > 0, totals.gather(-1, (b - 1).clamp_(min=0)), 0.0)  # [s, 1]
    k = torch.searchsorted(inside.cumsum(-1) + before, u, right=True)  # [s, 1]
    last = block - 1 - (inside > 0).flip(-1).int().argmax(-1, keepdim=True)  # its last token with mass
    return (b * block + torch.minimum(k, last)).squeeze(-1)


def _hits_stop(tokenizer: PreTrainedTokenizerBase, tail: list[int], stop: tuple[str, ...]) -> bool:
    """True when the decoded tail of a response contains a stop string (checked every token)."""
    text = tokenizer.decode(tail, skip_special_tokens=False)
    return any(s in text for s in stop)
