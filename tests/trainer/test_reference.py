"""The reference policy kept on disk between reference passes: bitwise the log-probs of one kept in
memory, no parameter memory held between uses, and an RL run identical to one with the reference in memory."""

import copy

import torch
from safetensors.torch import load_file

from agent_r1.trainer import reference
from agent_r1.trainer.reference import reference_policy
from agent_r1.trainer.rl import train
from tests.trainer.conftest import TASKS, LowIdEnv, tiny_model, toy_config


def test_a_reference_on_disk_computes_what_one_in_memory_does_and_holds_nothing_between_uses(tmp_path):
    policy = tiny_model()
    ids = torch.randint(0, policy.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    in_memory = reference_policy(policy, 0.1, lora=False)
    on_disk = reference_policy(policy, 0.1, lora=False, offload_to=tmp_path / "ref.safetensors")
    with torch.no_grad():
        policy.lm_head.weight.add_(1.0)  # the policy trains on; the references keep the starting weights
    with in_memory() as ref, torch.no_grad():
        expected = ref(ids).logits
    for _ in range(2):  # read back for every use
        with on_disk() as ref, torch.no_grad():
            assert torch.equal(ref(ids).logits, expected)
            assert ref.lm_head.weight is ref.model.embed_tokens.weight  # still tied
        held = sum(p.numel() for p in ref.parameters())
        assert held == 0  # between uses the weights live only in the file


def test_rl_with_the_reference_on_disk_is_the_same_run(tmp_path, tokenizer, monkeypatch):
    reads = []
    monkeypatch.setattr(reference, "load_file", lambda *a, **k: reads.append(a) or load_file(*a, **k))
    runs = []
    for name, extra in (("memory", []), ("disk", ["algo.reference_on_disk=true"])):
        cfg = toy_config(tmp_path / name, "steps=2", "algo.kl_coef=0.1", "algo.zero_variance_groups=keep", *extra)
        model = tiny_model()
        hist = train(cfg, model=copy.deepcopy(model), tokenizer=tokenizer, make_env=LowIdEnv, tasks=TASKS)
        runs.append([(h["kl"], h["reward_mean"], h["grad_norm"]) for h in hist])
    assert runs[0] == runs[1] and runs[0][-1][0] > 0  # a KL that moved, bitwise the same
    assert len(reads) == 2  # the disk run read its reference back once per step
    assert not (tmp_path / "disk" / "run" / "reference.safetensors").exists()  # removed when training ends
