"""`Dist`: this process's place in a torchrun job, and the few collectives the trainer needs.

torchrun starts N copies of `agent-r1 train` and tells each its rank through the environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT). `init_distributed` joins the process group (gloo on
a CPU, NCCL on a GPU); a plain `agent-r1 train` is world 1 and every collective below is the identity,
so the trainer has one code path. Objects (trajectories, metrics) move with the *_object collectives:
they are small next to the weights, and pickling keeps the token ids exact.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, NoReturn, TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True)
class Dist:
    """Rank and world size; collectives that are no-ops in a single process."""

    rank: int = 0
    world: int = 1
    owns_group: bool = False
    """`init_distributed` started the process group, so `close` ends it"""

    @property
    def main(self) -> bool:
        """Rank 0 alone logs, writes records and exports."""
        return self.rank == 0

    def shard(self, items: Sequence[T], cost: Callable[[T], int]) -> list[T]:
        """This rank's share of `items` (the same list on every rank), balanced by `cost`: longest
        first, each to the least-loaded rank, ties to the lower rank. Order is kept within a share."""
        if self.world == 1:
            return list(items)
        load = [0] * self.world
        owner = [0] * len(items)
        for i in sorted(range(len(items)), key=lambda i: (-cost(items[i]), i)):
            r = min(range(self.world), key=lambda r: (load[r], r))
            owner[i] = r
            load[r] += cost(items[i])
        return [x for x, r in zip(items, owner, strict=True) if r == self.rank]

    def sum(self, *values: float) -> list[float]:
        """Each value summed over ranks (fp64: token counts stay exact)."""
        return self._reduce(values, torch.distributed.ReduceOp.SUM if self.world > 1 else None)

    def max(self, value: int) -> int:
        return int(self._reduce([value], torch.distributed.ReduceOp.MAX if self.world > 1 else None)[0])

    def all(self, flag: bool) -> bool:
        """True on every rank iff true on every rank (a NaN on one rank skips the step everywhere)."""
        return bool(self._reduce([float(flag)], torch.distributed.ReduceOp.MIN if self.world > 1 else None)[0])

    def gather(self, obj: T) -> list[T]:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's `obj` on every rank."""
        if self.world == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        """Wait for every rank (none leaves before rank 0 has exported), then end the process group this
        process started, as PyTorch asks of a finished job; a group someone else started is theirs to
        end. A torchrun rank then leaves through `end_rank`."""
        self.barrier()
        if self.owns_group:
            torch.distributed.destroy_process_group()

    @contextlib.contextmanager
    def failure_report(self) -> Iterator[SimpleNamespace]:
        """Name the rank and the step of an exception on its way out (set `report.step` as you go).
        torchrun then stops the other ranks, which would otherwise wait in a collective."""
        report = SimpleNamespace(step=0)
        try:
            yield report
        except BaseException as exc:
            if self.world > 1:
                print(f"rank {self.rank} failed at step {report.step}: {type(exc).__name__}: {exc}", file=sys.stderr)
            raise

    def _reduce(self, values: Sequence[float], op: Any) -> list[float]:
        if op is None:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_collective_device())
        torch.distributed.all_reduce(t, op=op)
        return t.tolist()


def end_rank(code: int = 0) -> NoReturn:
    """Leave a torchrun rank whose work is done and written, skipping the interpreter's C++ teardown.

    With torch 2.13's gloo, that teardown aborted a rank in 2 of 30 runs of a finished 2-process job
    ("terminate called without an active exception", SIGABRT, with no Python frame left, after
    `Dist.close`), and torchrun then reports the whole job failed. Output is flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def contiguous_shards(items: Sequence[T], n: int) -> list[tuple[int, list[T]]]:
    """`items` cut into `n` consecutive shards whose sizes differ by at most one, each with the index of
    its first item: gathered in order, the shards' results are the whole batch's, in its order."""
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for k in range(n):
        end = start + size + (k < extra)
        out.append((start, list(items[start:end])))
        start = end
    return out


SINGLE = Dist()  # a plain process: every collective is the identity


class RankShards:
    """Lockstep under torchrun: each rank rolls out its consecutive share of a step's cohort over its own
    engine, and every rank gets the whole batch, in task order, with the seeds one loop would give it. The
    gather runs on the producer's thread while the trainer waits in `take` (no other collective runs then)."""

    def __init__(self, runner: Any, dist: Dist) -> None:
        self.runner, self.dist, self.engine = runner, dist, runner.engine
        self._gather_s = 0.0

    async def run(self, make_env: Any, tasks: list, group_size: int, seed: int, first_index: int, cohort: bool) -> list:
        start, mine = contiguous_shards(tasks, self.dist.world)[self.dist.rank]
        mine = await self.runner.run(make_env, mine, group_size, seed, first_index + start * group_size, cohort)
        t0 = time.perf_counter()
        out = [t for part in self.dist.gather(mine) for t in part]
        self._gather_s += time.perf_counter() - t0
        return out

    def sync_weights(self, model: torch.nn.Module, version: int, between_tokens: bool) -> dict[str, float]:
        return self.runner.sync_weights(model, version, between_tokens)

    def idle(self) -> None:
        self.runner.idle()

    def take_metrics(self) -> dict[str, float]:
        out, self._gather_s = {"time/gather_trajectories": self._gather_s}, 0.0
        return out | self.runner.take_metrics()

    def close(self) -> None:
        self.runner.close()


class RankZero:
    """Asynchronous RL under torchrun: one producer, on rank 0, whose batches every rank takes (a stalled
    producer stops every rank); only rank 0's engine rolls out and gets the weights."""

    def __init__(self, producer: Any | None, dist: Dist) -> None:
        self.producer, self.dist = producer, dist
        self.engine = producer.engine if producer else None

    def take(self) -> tuple[list, dict[str, float]]:
        try:
            out: Any = self.producer.take() if self.producer else None
        except Exception as exc:  # RolloutStalled: raised on every rank
            out = exc
        out = self.dist.broadcast(out)
        if isinstance(out, Exception):
            raise out
        return out

    def publish(self, model: torch.nn.Module) -> dict[str, float]:
        return self.producer.publish(model) if self.producer else {}

    def switch(self, sampler: Any, make_env: Any) -> None:
        if self.producer:
            self.producer.switch(sampler, make_env)

    def state(self) -> dict[str, Any]:
        return self.producer.state() if self.producer else {}

    def close(self) -> None:
        if self.producer:
            self.producer.close()


def _collective_device() -> torch.device:
    """NCCL reduces CUDA tensors, gloo CPU ones."""
    return torch.device("cuda") if torch.distributed.get_backend() == "nccl" else torch.device("cpu")


def init_distributed(device: str, timeout_s: float = 1800.0) -> Dist:
    """Join torchrun's process group when launched by it (WORLD_SIZE > 1), else a single process.

    Each rank uses GPU LOCAL_RANK on a GPU machine. A torch.distributed job whose process group is
    already up (a test, a user's own launcher) is joined as it is."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return SINGLE
    owns = not torch.distributed.is_initialized()
    if owns:
        cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    return Dist(torch.distributed.get_rank(), torch.distributed.get_world_size(), owns_group=owns)
