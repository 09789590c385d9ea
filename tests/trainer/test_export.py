"""`agent-r1 export`: a checkpoint becomes a Hugging Face directory that greedy-decodes like it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent_r1.cli import main
from agent_r1.config import to_dict
from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.env.prompt_format import ChatFormat
from agent_r1.models.lora import with_lora
from agent_r1.trainer.checkpoint import save_checkpoint
from agent_r1.trainer.config import LoraConfig
from tests.conftest import make_tiny_llama


def trained_checkpoint(tmp_path, tokenizer, lora: bool):
    """A run directory whose checkpoint holds weights that differ from the base model's."""
    base = tmp_path / "base"
    make_tiny_llama(len(tokenizer), eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id).save_pretrained(base)
    tokenizer.save_pretrained(base)
    lora_cfg = LoraConfig(enabled=lora, r=4, target_modules=("q_proj", "v_proj", "down_proj"))
    policy = AutoModelForCausalLM.from_pretrained(base)
    policy = with_lora(policy, lora_cfg) if lora else policy
    torch.manual_seed(0)
    with torch.no_grad():  # "training": move what training would move (the adapters, or every weight)
        for p in (p for p in policy.parameters() if p.requires_grad):
            p.add_(torch.randn_like(p) * (0.5 if lora else 0.05))
    optimizer = torch.optim.SGD([p for p in policy.parameters() if p.requires_grad], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    config = {"model": str(base), "lora": to_dict(lora_cfg), "prompt_format": "auto"}
    save_checkpoint(tmp_path / "run", 3, {"policy": policy}, optimizer, scheduler, {"cursor": 0, "config": config})
    return tmp_path / "run", policy.eval(), base


def greedy(model, tokenizer, prompts):
    engine = LocalEngine(model, tokenizer, max_context=1024)
    return engine.generate_batch(prompts, SamplingParams(max_new_tokens=12, temperature=0.0), seeds=[0] * len(prompts))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_exported_model_decodes_like_the_checkpoint(tmp_path, tokenizer, lora):
    run, policy, base = trained_checkpoint(tmp_path, tokenizer, lora)
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0

    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in name for name, _ in exported.named_parameters())  # merged, a plain model
    prompts = [ChatFormat(tokenizer).initial([{"role": "user", "content": q}]) for q in ("What is 6 * 7?", "Hi")]
    want = greedy(policy, tokenizer, prompts)
    got = greedy(exported, tokenizer, prompts)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    untrained = greedy(AutoModelForCausalLM.from_pretrained(base).eval(), tokenizer, prompts)
    pairs = [(a, b) for u, w in zip(untrained, want, strict=True) for a, b in zip(u.logprobs, w.logprobs, strict=True)]
    assert max(abs(a - b) for a, b in pairs) > 1e-3  # the trained weights really were exported

    assert AutoTokenizer.from_pretrained(out).chat_template == tokenizer.chat_template
    info = json.loads((out / "agent_r1.json").read_text())
    assert info["prompt_format"] == "chat" and info["tool_call_format"]["name"] == "hermes"
    assert info["step"] == 3 and info["lora_merged"] is lora and info["base_model"] == str(base)


def test_a_checkpoint_directory_itself_can_be_exported(tmp_path, tokenizer):
    run, _, _ = trained_checkpoint(tmp_path, tokenizer, lora=False)
    assert main(["export", str(run / "checkpoints" / "step_000003"), "out=" + str(tmp_path / "x")]) == 0
    assert (tmp_path / "x" / "config.json").is_file()


def test_recorded_prompt_format_wins_over_the_template(tmp_path, tokenizer):
    from agent_r1.models.loading import is_chat_model

    (tmp_path / "agent_r1.json").write_text(json.dumps({"prompt_format": "text"}))
    assert is_chat_model(str(tmp_path), tokenizer) is False  # a base model trained with plain text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["export", "/no/such/run", "--out", "x"], "no checkpoint in /no/such/run"),
        (["export", "--out", "x"], "usage: agent-r1 export"),
    ],
)
def test_bad_export_arguments_give_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_killed_export_loses_nothing_and_leaves_nothing(tmp_path, tokenizer, monkeypatch):
    """SIGKILL runs no `finally`: between setting the previous export aside and renaming the new one in,
    a kill leaves only `.export-old-policy`. The next export puts it back first, so it is never lost,
    and clears what the killed one left; a failed export restores the previous one."""
    from agent_r1.trainer import checkpoint

    model = make_tiny_llama(len(tokenizer), hidden=32, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)
    out = tmp_path / "policy"
    (tmp_path / ".export-old-policy").mkdir()  # the state a kill between the renames leaves
    (tmp_path / ".export-old-policy" / "agent_r1.json").write_text('{"previous": true}')
    (tmp_path / ".export-new-abc123-policy").mkdir()  # a half-written export
    monkeypatch.setattr(checkpoint, "merged_copy", lambda m, cpu: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        checkpoint.export_policy(model, tokenizer, out, info={"new": True})
    assert json.loads((out / "agent_r1.json").read_text()) == {"previous": True}  # put back, not lost
    monkeypatch.undo()
    checkpoint.export_policy(model, tokenizer, out, info={"new": True})
    assert json.loads((out / "agent_r1.json").read_text()) == {"new": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]  # no leftovers
