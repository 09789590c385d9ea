"""Where one RL step's memory goes: RSS sampled every 10 ms inside `agent-r1 train`, labelled by phase.

    python benchmarks/rl_step_memory.py runs/demo/rl/config.yaml steps=2 val.every=0 run_dir=runs/mem_step

Runs the trainer in this process with the given config and overrides, wrapping the functions that mark a
step's phases (rollout, reference log-probs, each micro-batch's forward and backward, the optimizer step,
the checkpoint, validation) so that every RSS sample is attributed to the phase it fell in. Prints each phase's peak
and time, and the step times the trainer logged. Linux only (it reads /proc/self/statm).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
import time
from pathlib import Path

import torch

from agent_r1.cli import quiet_third_party
from agent_r1.config import load_config
from agent_r1.trainer import rl, update
from agent_r1.trainer.config import TrainConfig
from agent_r1.trainer.validation import Validator
from agent_r1.utils.malloc import fix_mmap_threshold

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Phases:
    """The current phase's name, and the peak RSS and seconds seen in each phase."""

    def __init__(self) -> None:
        self.name = "setup"
        self.peak: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.done = False
        self.events: list[tuple[str, float]] = []  # (phase entered, RSS GB then), in order

    @contextlib.contextmanager
    def phase(self, name: str):
        outer, start = self.name, time.perf_counter()
        self.name = name
        self.events.append((name, rss() / 1e9))
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.name = outer

    def wrap(self, owner, attr: str, name: str) -> None:
        fn = getattr(owner, attr)

        def wrapped(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)

        setattr(owner, attr, wrapped)

    def sample(self, interval: float = 0.01) -> None:
        while not self.done:
            self.peak[self.name] = max(self.peak.get(self.name, 0), rss())
            time.sleep(interval)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--trace", action="store_true", help="print the RSS as each phase began, in order")
    parser.add_argument("--out", type=Path, default=Path("runs/bench/rl_step_memory.json"))
    args = parser.parse_args()
    fix_mmap_threshold()  # as the CLI does at start-up
    quiet_third_party(True)
    cfg = load_config(TrainConfig, str(args.config), args.overrides)
    p = Phases()
    p.wrap(rl.AgentEnvLoop, "run_sync", "rollout")
    p.wrap(rl, "fill_ref_logprobs", "reference")
    p.wrap(rl, "recompute_old_logprobs", "old log-probs")
    p.wrap(rl, "save_checkpoint", "checkpoint")
    p.wrap(Validator, "__call__", "validation")
    forward = update.token_logprobs

    def traced_forward(model, mb, *args, **kwargs):  # the micro-batch's size in the phase name of its forward
        name = f"update: forward of {mb.num_tokens} tokens ({len(mb.rows)} rows, {int(mb.mask.sum())} sampled)"
        with p.phase(name):
            return forward(model, mb, *args, **kwargs)

    update.token_logprobs = traced_forward
    p.wrap(torch.Tensor, "backward", "update: backward")
    p.wrap(torch.optim.AdamW, "step", "update: optimizer")
    p.wrap(rl, "policy_update", "update: other")  # the outer label; the three above nest inside it
    thread = threading.Thread(target=p.sample, daemon=True)
    thread.start()
    with p.phase("train"):
        history = rl.train(cfg)
    p.done = True
    thread.join()
    if args.trace:
        print("\nRSS (GB) as each phase began:")
        for name, gb in p.events:
            print(f"  {gb:6.2f}  {name}")
    forwards = [n for n in p.peak if n.startswith("update: forward of")]
    largest = max(forwards, key=lambda n: p.peak[n]) if forwards else None
    print(f"\n{'phase':<60}{'peak GB':>9}{'seconds':>9}")
    for name in sorted(p.peak, key=lambda n: -p.peak[n]):
        if name in forwards and name != largest:
            continue
        print(f"{name:<60}{p.peak[name] / 1e9:>9.2f}{p.seconds.get(name, 0.0):>9.1f}")
    keys = ("time/rollout", "time/reference", "time/update", "time/step", "train_tokens", "loss", "grad_norm")
    for m in history:
        if "time/step" in m:
            print("  ".join(f"{k}={m[k]:.4g}" for k in keys if k in m))
    print(f"peak RSS {max(p.peak.values()) / 1e9:.2f} GB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"peak": p.peak, "seconds": p.seconds, "history": history}, default=float))


if __name__ == "__main__":
    main()
