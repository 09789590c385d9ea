"""Device and precision: `device=` resolution, bf16 autocast over fp32 weights, and every tensor on the
model's device (proven on a CPU-only machine by making the default device `meta`: a tensor created
without an explicit device then lands on `meta` and any op mixing it with the model's fails)."""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.models.precision import (
    autocast,
    cpu_copy,
    model_device,
    resolve_device,
    rng_state,
    set_precision,
    set_rng_state,
)
from agent_r1.trainer.batching import Row, pack, token_logprobs
from agent_r1.trainer.critic import Critic
from agent_r1.trainer.update import policy_update
from tests.conftest import make_tiny_llama
from tests.trainer.conftest import toy_config


def rows(n=3):
    out = []
    for i in range(n):
        ids = torch.tensor([5, 6, 7, 8, 9 + i, 10 + i, 11 + i, 12])  # a shared prefix of 4 tokens
        mask = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.float32)
        out.append(Row(ids, mask, torch.zeros(8), torch.ones(8), torch.zeros(8, dtype=torch.long)))
    return out


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device must be auto, cpu or cuda, got 'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device=cuda but torch sees no CUDA GPU"):
            resolve_device("cuda")


def test_micro_batches_go_to_the_requested_device_and_rows_stay():
    data = rows()
    (mb,) = pack(data, 256, min_shared_prefix=2, device="meta")
    for name in ("input_ids", "position_ids", "mask", "old_logp", "adv", "seg"):
        assert getattr(mb, name).device.type == "meta", name
    assert mb.prefix_len == 4 and all(r.input_ids.device.type == "cpu" for r in data)  # the 4 shared tokens


@pytest.mark.parametrize("shared_prefix", [2, 100])  # the shared-prefix forward and the packed one
def test_the_trainer_forward_and_backward_create_nothing_off_the_models_device(shared_prefix):
    model = make_tiny_llama(64, hidden=32)
    mbs = pack(rows(), 256, min_shared_prefix=shared_prefix, device=model_device(model))
    want = [token_logprobs(model, mb)[0] for mb in mbs]
    with torch.device("meta"):  # anything created without device= would be meta and break the ops below
        for mb, w in zip(mbs, want, strict=True):
            logp, ent, hidden = token_logprobs(model, mb, 0.7, entropy=True, hidden=True)
            (logp.sum() + ent.sum()).backward()
            assert logp.device.type == "cpu" and hidden.device.type == "cpu"
            assert torch.allclose(token_logprobs(model, mb)[0], w, atol=1e-6)


def test_the_local_engine_creates_nothing_off_the_models_device(tokenizer):
    model = make_tiny_llama(len(tokenizer), hidden=32, eos=tokenizer.eos_token_id, pad=tokenizer.pad_token_id)
    engine = LocalEngine(model, tokenizer, seed=0, max_context=256, min_shared_prefix=2)
    prompts = [tokenizer.encode("one two three four five"), tokenizer.encode("one two three four six seven")]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9, stop=("x",))
    want = engine.generate_batch(prompts, params, seeds=[1, 2])
    with torch.device("meta"):
        got = engine.generate_batch(prompts, params, seeds=[1, 2])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_bf16_autocasts_matrix_products_over_fp32_weights_and_keeps_logprobs_fp32():
    model = make_tiny_llama(64, hidden=32)
    (mb,) = pack(rows(), 256, min_shared_prefix=100)
    fp32 = token_logprobs(model, mb)[0]
    seen = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    set_precision(model, "bf16")
    logp = token_logprobs(model, mb)[0]
    hook.remove()
    assert seen == [torch.bfloat16]  # the matrix products ran in bf16 ...
    assert next(model.parameters()).dtype == torch.float32  # ... over fp32 master weights
    assert logp.dtype == torch.float32 and 0 < (logp - fp32).abs().max() < 5e-2  # log-softmax in fp32
    set_precision(model, "fp32")
    assert isinstance(autocast(model), contextlib.nullcontext)  # fp32: no autocast
    with pytest.raises(ValueError, match="dtype must be fp32 or bf16, got 'fp16'"):
        set_precision(model, "fp16")


def test_the_lm_head_runs_in_fp32_under_bf16_autocast_and_large_logits_keep_their_log_probs():
    """bf16 logits at |z| ~ 30 would be off by up to 0.06 nats; the head runs in fp32 over the fp32 hidden
    states, so the trainer's log-probs under bf16 are the fp32 log-softmax of those states to 1e-5."""
    model = make_tiny_llama(64, hidden=32)
    with torch.no_grad():
        model.model.norm.weight.mul_(40)  # large logits, as a trained model's peaked ones
    (mb,) = pack(rows(), 256, min_shared_prefix=100)
    set_precision(model, "bf16")
    assert type(model.lm_head).__name__ == "Fp32Head" and model.lm_head.weight.dtype == torch.float32
    logp, _, states = token_logprobs(model, mb, hidden=True)
    targets = mb.mask.nonzero().squeeze(-1)
    logits = states[targets - 1].float() @ model.lm_head.weight.T  # [M, V] fp32, by hand, outside autocast
    assert logits.abs().max() > 20
    picked = torch.arange(len(targets)), mb.input_ids[targets]
    want = torch.log_softmax(logits, -1)[picked]
    assert (logp[targets] - want).abs().max() < 1e-5
    # what a bf16 head would give from the same states: far off, so the check above can tell the two apart
    rounded = (states[targets - 1].bfloat16() @ model.lm_head.weight.T.bfloat16()).float()
    assert (torch.log_softmax(rounded, -1)[picked] - want).abs().max() > 1e-2
    with autocast(model):  # the engines' forward too: the head's output is fp32 under autocast
        assert model(torch.tensor([[5, 6, 7]])).logits.dtype == torch.float32
    stored_bf16 = make_tiny_llama(64, hidden=32).to(torch.bfloat16)  # inference weights in bf16: left alone
    assert type(set_precision(stored_bf16, "bf16").lm_head).__name__ != "Fp32Head"


def test_the_cpu_suite_sees_no_gpu_wherever_it_runs():
    """tests/conftest.py hides CUDA from every test not marked `gpu`, in this process and its children."""
    assert resolve_device("auto") == torch.device("cpu") and os.environ["CUDA_VISIBLE_DEVICES"] == ""


def test_rng_state_round_trip():
    state = rng_state()
    a = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), a)
    assert ("cuda" in state) == torch.cuda.is_available()


@pytest.mark.skipif(
    torch.torch_version.TorchVersion(torch.__version__) < "2.13",
    reason="torch < 2.13's AdamW makes its step counter on the default device (seen with 2.11 on an H200); "
    "the project pins 2.13, where it is made on the CPU",
)
@pytest.mark.parametrize(
    "overrides", [[], ["algo.estimator=ppo", "algo.loss_agg=seq-mean-token-mean", "algo.kl_coef=0.1"]]
)
def test_the_policy_update_creates_nothing_off_the_models_device(tmp_path, overrides):
    model = make_tiny_llama(64, hidden=32)
    cfg = toy_config(tmp_path, *overrides)
    critic = Critic(model, "head") if cfg.algo.estimator == "ppo" else None
    params = [p for m in (model, critic) if m is not None for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    data = rows()
    for r in data:
        r.ref_logp, r.old_values, r.returns = torch.zeros(8), torch.zeros(8), torch.ones(8)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.device("meta"):
        out = policy_update(model, critic, data, optimizer, scheduler, params, cfg, 0)
    assert out["updates"] == 1 and out["skipped_nonfinite"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@contextlib.contextmanager
def no_tensor_deepcopy():
    """Deep-copying a tensor (what `copy.deepcopy(model)` does to each weight, on the weight's device) raises."""

    def refuse(self, memo):
        raise AssertionError(f"a {tuple(self.shape)} tensor was deep-copied on {self.device}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "__deepcopy__", refuse)
        patch.setattr(torch.nn.Parameter, "__deepcopy__", refuse)
        yield


def test_cpu_copy_moves_each_weight_once_and_never_clones_one_where_it_lives():
    model = make_tiny_llama(64, hidden=32)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    with no_tensor_deepcopy():
        with pytest.raises(AssertionError, match="deep-copied"):
            copy.deepcopy(model)  # the refusal is real: a plain deepcopy clones every weight in place
        copied = cpu_copy(model)
    assert copied.lm_head.weight is copied.model.embed_tokens.weight  # still tied
    assert not copied.model.layers[0].mlp.up_proj.weight.requires_grad
    originals = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
    for name, t in [*copied.named_parameters(), *copied.named_buffers()]:
        assert t.device.type == "cpu" and t.data_ptr() not in originals, name
    want, got = model.state_dict(), copied.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], t) for k, t in got.items())
    x = torch.tensor([[5, 6, 7]])
    assert torch.equal(model(x).logits, copied(x).logits)


def test_exports_checkpoints_and_rays_model_are_copied_to_the_cpu_not_cloned_on_the_device(tmp_path, tokenizer):
    from agent_r1.config import load_config
    from agent_r1.trainer.checkpoint import export_policy, trainable_state
    from agent_r1.trainer.config import TrainConfig
    from agent_r1.trainer.setup import _engine_source

    model = make_tiny_llama(len(tokenizer), hidden=32)
    cfg = load_config(TrainConfig, None, ["cluster.rollout_workers=2"])
    with no_tensor_deepcopy():
        export_policy(model, tokenizer, tmp_path / "export")
        state = trainable_state(model)
        shipped = _engine_source(cfg, model, tokenizer, tmp_path, from_config=False)
    assert (tmp_path / "export" / "model.safetensors").exists()
    assert state.keys() == dict(model.named_parameters()).keys()
    assert shipped is not model and all(p.device.type == "cpu" for p in shipped.parameters())
