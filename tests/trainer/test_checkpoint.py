"""A crash mid-save never leaves a checkpoint that resume would load."""

from pathlib import Path

import pytest
import torch

from agent_r1.trainer import checkpoint as ck


def parts():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    return model, opt, sched


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt, sched = parts()
    ck.save_checkpoint(tmp_path, 1, {"policy": model}, opt, sched, {"cursor": 4})
    with torch.no_grad():
        model.weight.add_(1.0)

    def die(*args, **kwargs):
        raise KeyboardInterrupt  # as if killed while writing the trainer state

    monkeypatch.setattr(ck.torch, "save", die)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(tmp_path, 2, {"policy": model}, opt, sched, {"cursor": 8})
    assert ck.latest_checkpoint(tmp_path).name == "step_000001"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]


def test_half_written_directories_are_ignored(tmp_path):
    model, opt, sched = parts()
    ck.save_checkpoint(tmp_path, 3, {"policy": model}, opt, sched, {"cursor": 0})
    (tmp_path / "checkpoints" / ".tmp-step_000004-abc").mkdir()  # a kill -9 leftover
    (tmp_path / "checkpoints" / "step_000005").mkdir()  # no meta.json: incomplete
    assert ck.latest_checkpoint(tmp_path).name == "step_000003"


def test_round_trip_restores_weights_optimizer_and_rng(tmp_path):
    model, opt, sched = parts()
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    torch.manual_seed(123)
    path = ck.save_checkpoint(tmp_path, 7, {"policy": model}, opt, sched, {"cursor": 21})
    expected_draw = torch.rand(3)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    other, opt2, sched2 = parts()
    meta = ck.load_checkpoint(path, {"policy": other}, opt2, sched2)
    assert meta["step"] == 7 and meta["cursor"] == 21
    assert all(torch.equal(saved[k], v) for k, v in other.state_dict().items())
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(torch.rand(3), expected_draw)


def test_a_crash_during_export_keeps_the_previous_policy_and_its_note(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    from tests.conftest import make_tiny_llama

    model = make_tiny_llama(len(tokenizer), hidden=32)
    ck.export_policy(model, tokenizer, tmp_path / "policy", extra={"best.json": '{"step": 2}'})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        next(model.parameters()).add_(1.0)

    class Dying:
        def save_pretrained(self, path):
            raise KeyboardInterrupt  # killed after the weights, before the tokenizer and the note

    with pytest.raises(KeyboardInterrupt):
        ck.export_policy(model, Dying(), tmp_path / "policy", extra={"best.json": '{"step": 5}'})
    assert (tmp_path / "policy" / "best.json").read_text() == '{"step": 2}'
    kept = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").state_dict()
    assert all(torch.equal(kept[n], p) for n, p in before.items())
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]  # no half-written export left behind


def test_a_kill_while_pruning_leaves_no_step_directory_without_its_weights(tmp_path, monkeypatch):
    """rmtree deletes file by file; killed after the weights but before meta.json, a pruned checkpoint
    kept in place would still look complete. It is renamed away first, and the next save deletes it."""
    model, opt, sched = parts()
    for step in (1, 2):
        ck.save_checkpoint(tmp_path, step, {"policy": model}, opt, sched, {"cursor": step}, keep=2)
    real_rmtree = ck.shutil.rmtree

    def killed_midway(path, ignore_errors=False):
        path = Path(path)
        if (path / "meta.json").is_file():
            (path / "policy.safetensors").unlink()
            raise KeyboardInterrupt  # SIGKILL: nothing after this line runs
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(ck.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(tmp_path, 3, {"policy": model}, opt, sched, {"cursor": 3}, keep=2)
    root = tmp_path / "checkpoints"
    for step_dir in (d for d in root.iterdir() if d.name.startswith("step_")):
        assert (step_dir / "policy.safetensors").is_file(), step_dir.name
    assert sorted(d.name for d in root.iterdir() if d.name.startswith("step_")) == ["step_000002", "step_000003"]
    monkeypatch.setattr(ck.shutil, "rmtree", real_rmtree)
    ck.save_checkpoint(tmp_path, 4, {"policy": model}, opt, sched, {"cursor": 4}, keep=2)
    assert sorted(d.name for d in root.iterdir()) == ["step_000003", "step_000004"]


def test_the_next_save_deletes_what_killed_saves_left(tmp_path):
    """SIGKILL skips `finally`: a save killed mid-write leaves its .tmp- directory (as big as a
    checkpoint). Resume ignores it, and the next save deletes it."""
    model, opt, sched = parts()
    root = tmp_path / "checkpoints"
    for name in (".tmp-step_000001-abc", ".tmp-step_000001-def", ".tmp-remove-step_000000"):
        (root / name).mkdir(parents=True)
        (root / name / "policy.safetensors").write_bytes(b"half")
    ck.save_checkpoint(tmp_path, 1, {"policy": model}, opt, sched, {"cursor": 0})
    assert [d.name for d in root.iterdir()] == ["step_000001"]
