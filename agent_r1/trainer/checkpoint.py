"""Atomic checkpoints with exact resume, and export of the policy to a Hugging Face directory.

A checkpoint is written into a temporary directory and renamed into place only once complete, so
a crash or kill mid-save leaves either the previous checkpoints or the new one, never half of one.
`latest_checkpoint` only considers directories named `step_NNNNNN` that hold `meta.json` (the last
file written), and the last `keep` of them survive. A checkpoint is deleted the same way round:
renamed to a temporary name first, so a kill mid-delete never leaves a `step_NNNNNN` that lacks some
of its files; the next save removes what a kill left under a temporary name. A torchrun job's
checkpoint is sharded: every rank writes its part with `torch.distributed.checkpoint`, and rank 0
renames the whole once all have.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from agent_r1.distributed.group import SINGLE, Dist
from agent_r1.models.loading import EXPORT_INFO
from agent_r1.models.lora import merged_copy
from agent_r1.models.precision import rng_state, set_rng_state

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that training changes: all of them, or only the LoRA adapters, copied to the CPU
    (never cloned on a GPU, where vLLM may hold the rest of the memory)."""
    return {n: p.detach().to("cpu", copy=True).contiguous() for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    modules: dict[str, torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    extra: dict[str, Any],
    keep: int = 2,
    dist: Dist = SINGLE,
) -> Path:
    """Write checkpoint `step` atomically; prune all but the newest `keep`; return its path.
    Under torchrun every rank calls it and writes its own shards (`_save_sharded`)."""
    if dist.world > 1:
        return _save_sharded(Path(run_dir), step, modules, optimizer, scheduler, extra, keep, dist)
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    final = root / f"step_{step:06d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-step_{step:06d}-"))
    try:
        for name, module in modules.items():
            save_file(trainable_state(module), str(tmp / f"{name}.safetensors"))
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "torch_rng": rng_state(),  # CPU and CUDA
                "python_rng": random.getstate(),
            },
            tmp / "trainer_state.pt",
        )
        (tmp / "meta.json").write_text(json.dumps({"step": step, **extra}, indent=1))  # written last
        _fsync_dir(tmp)
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it
            _remove(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _prune(root, keep)
    return final


def _prune(root: Path, keep: int) -> None:
    for old in sorted(_complete(root))[:-keep] if keep > 0 else []:
        _remove(old[1])


def _remove(checkpoint: Path) -> None:
    """Delete a checkpoint directory: renamed out of the `step_NNNNNN` names first, because rmtree
    deletes file by file, and a kill in between would leave a directory that still holds meta.json
    (and so looks complete) without its weights."""
    doomed = checkpoint.with_name(f".tmp-remove-{checkpoint.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(checkpoint, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _remove_leftovers(root: Path) -> None:
    """Delete the temporary directories of saves and deletes that a kill interrupted (SIGKILL runs no
    `finally`); each can hold a whole checkpoint. Only this run's trainer writes under `root`."""
    for d in root.iterdir():
        if d.name.startswith(".tmp-"):
            shutil.rmtree(d, ignore_errors=True)


def _save_sharded(
    run_dir: Path, step: int, modules: dict, optimizer: torch.optim.Optimizer, scheduler: Any, extra: dict,
    keep: int, dist: Dist,
) -> Path:  # fmt: skip
    """A torchrun job's checkpoint: every rank writes its shards of the weights and of the AdamW state
    with `torch.distributed.checkpoint` (DCP) into `state/`, and its own RNG state; rank 0 adds the
    scheduler, meta.json last, and renames the directory into place once every rank has written."""
    root = run_dir / "checkpoints"
    final, tmp = root / f"step_{step:06d}", root / f".tmp-step_{step:06d}"
    if dist.main:
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(root)  # a save killed half-way
        tmp.mkdir()
    dist.barrier()
    model_state, optim_state = get_state_dict(torch.nn.ModuleDict(modules), optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp / "state")
    torch.save({"torch_rng": rng_state(), "python_rng": random.getstate()}, tmp / f"rng_rank{dist.rank}.pt")
    dist.barrier()
    if dist.main:
        torch.save({"scheduler": scheduler.state_dict()}, tmp / "trainer_state.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, "world_size": dist.world, **extra}, indent=1))
        _fsync_dir(tmp)
        if final.exists():
            _remove(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        _prune(root, keep)
    dist.barrier()
    return final


def _load_sharded(path: Path, modules: dict, optimizer: torch.optim.Optimizer, scheduler: Any, dist: Dist) -> None:
    """Restore a `_save_sharded` checkpoint on any number of ranks: DCP reads each rank's part of every
    tensor from whichever shards hold it. A rank the writing job did not have takes rank 0's RNG state
    (sampling and shuffles are seeded by step, so the RNG does not decide what a resumed run does)."""
    model_state, optim_state = get_state_dict(torch.nn.ModuleDict(modules), optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path / "state")
    set_state_dict(
        torch.nn.ModuleDict(modules), optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    scheduler.load_state_dict(torch.load(path / "trainer_state.pt", weights_only=False)["scheduler"])
    rng_file = path / f"rng_rank{dist.rank}.pt"
    rng = torch.load(rng_file if rng_file.exists() else path / "rng_rank0.pt", weights_only=False)
    set_rng_state(rng["torch_rng"])
    random.setstate(rng["python_rng"])


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run, or None."""
    found = _complete(Path(run_dir) / "checkpoints")
    return max(found)[1] if found else None


def load_checkpoint(
    path: Path,
    modules: dict[str, torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    dist: Dist = SINGLE,
) -> dict[str, Any]:
    """Restore modules, optimizer, scheduler and RNG states; return meta (step, data cursor, ...).
    A torchrun job's checkpoint resumes under torchrun on any number of processes (DCP reshards the
    weights and the AdamW state); one process's resumes in one process. The other crossings are a
    one-line error."""
    meta = json.loads((path / "meta.json").read_text())
    if ((saved := meta.get("world_size", 1)) > 1) != (dist.world > 1):
        how = "under torchrun (any --nproc_per_node >= 2)" if saved > 1 else "in one process (plain agent-r1 train)"
        raise ValueError(
            f"{path} was written by {saved} training process(es), this run has {dist.world}: resume it {how}"
        )
    if dist.world > 1:
        _load_sharded(path, modules, optimizer, scheduler, dist)
        return meta
    for name, module in modules.items():
        load_trained_state(path / f"{name}.safetensors", module)
    trainer_state = torch.load(path / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(trainer_state["optimizer"])
    scheduler.load_state_dict(trainer_state["scheduler"])
    rng = trainer_state["torch_rng"]
    set_rng_state(rng if isinstance(rng, dict) else {"cpu": rng})  # older checkpoints: the CPU state alone
    random.setstate(trainer_state["python_rng"])
    return meta


def load_sharded_weights(checkpoint: Path, name: str, module: torch.nn.Module) -> None:
    """Module `name`'s weights from a torchrun job's checkpoint into an unsharded `module`, in one
    process: DCP reassembles every rank's shards into the full tensors, in place."""
    with warnings.catch_warnings():  # "no process group: loading in a single process", which is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(
            {"model": {f"{name}.{k}": t for k, t in module.state_dict().items()}}, checkpoint_id=checkpoint / "state"
        )


def load_trained_state(file: Path, module: torch.nn.Module) -> None:
    """Copy the tensors `save_checkpoint` wrote for `module` back into it (a tensor it lacks is an error)."""
    state = load_file(str(file))
    params = dict(module.named_parameters())
    missing = set(state) - set(params)
    if missing:
        raise ValueError(f"checkpoint {file.parent} does not match the model: unknown tensors {sorted(missing)[:3]}")
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t)


def _complete(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and (d / "meta.json").is_file():
            out.append((int(m.group(1)), d))
    return out


def _fsync_dir(path: Path) -> None:
    """Flush a directory's files and entry to disk, so a rename after it publishes complete data."""
    for f in path.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_policy(
    model: torch.nn.Module,
    tokenizer: Any,
    out_dir: str | Path,
    info: dict[str, Any] | None = None,
    extra: dict[str, str] | None = None,
) -> Path:
    """Save the policy as a plain Hugging Face directory (LoRA merged) that from_pretrained loads.

    `info` becomes its agent_r1.json (prompt format, task, tool-call format: how chat, serve and eval
    must prompt it). `extra` files (name -> text, e.g. best.json) are written inside the same atomic
    rename, so the directory never holds weights without the notes that describe them."""
    out = Path(out_dir)
    old = out.with_name(f".export-old-{out.name}")
    _keep_previous(out, old)  # a kill between the two renames below
    if out.parent.exists():  # the rest a killed export left (`.export-*-NAME` names are only ever ours)
        for leftover in out.parent.glob(f".export-*-{out.name}"):
            shutil.rmtree(leftover, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent if out.parent.exists() else None, prefix=".export-new-"))
    tmp = tmp.rename(tmp.with_name(f"{tmp.name}-{out.name}"))
    try:
        policy = merged_copy(model, cpu=True)
        policy.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if info is not None:
            (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1))
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)
        if out.exists():  # set aside, not deleted, until the new one is in place: a kill loses neither
            os.replace(out, old)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        _keep_previous(out, old)  # the new export failed after the old one was set aside
        shutil.rmtree(old, ignore_errors=True)
    return out


def _keep_previous(out: Path, old: Path) -> None:
    """Put the previous export back where it was when no new one took its place."""
    if old.exists() and not out.exists():
        os.replace(old, out)


def resume(
    run_dir: str | Path,
    config: dict[str, Any],
    modules: dict[str, torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    may_change: tuple[str, ...] = (),
    dist: Dist = SINGLE,
) -> dict[str, Any] | None:
    """Restore the newest checkpoint of `run_dir` and return its meta (None: nothing to resume).

    The run must be the one that wrote it: a config that differs at any key but `may_change` (e.g. more
    steps) is refused with one line naming the key, before anything is loaded."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return None
    saved = json.loads((ckpt / "meta.json").read_text()).get("config") or {}
    now = json.loads(json.dumps(config))  # tuples as lists, like the saved copy
    if (key := first_difference(saved, now, skip=may_change)) is not None:
        raise ValueError(
            f"{run_dir} holds a run whose config differs at '{key}' ({_at(saved, key)!r} there, "
            f"{_at(now, key)!r} now): resume it with the same value, or train in a new run_dir"
        )
    return load_checkpoint(ckpt, modules, optimizer, scheduler, dist) | {"path": str(ckpt)}


def first_difference(a: Any, b: Any, skip: tuple[str, ...] = (), prefix: str = "") -> str | None:
    """The first dotted key where two nested config dicts differ (top-level keys in `skip` are ignored)."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return None if a == b else prefix.rstrip(".")
    for key in dict.fromkeys([*a, *b]):
        if key not in skip and (found := first_difference(a.get(key), b.get(key), (), f"{prefix}{key}.")):
            return found
    return None


def _at(config: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config
