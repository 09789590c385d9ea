"""Micro-batches: packing and shared-prefix forwards give the same log-probs and gradients as
running every row on its own."""

import pytest
import torch
import transformers

from agent_r1.trainer.batching import Row, pack, token_logprobs
from tests.trainer.conftest import tiny_model


def row(ids, first_sampled):
    ids = torch.tensor(ids)
    mask = torch.zeros(len(ids))
    mask[first_sampled:] = 1
    return Row(ids, mask, torch.zeros(len(ids)), torch.zeros(len(ids)), torch.zeros(len(ids), dtype=torch.long))


PREFIX = list(range(3, 43))  # 40 shared tokens


def rows():
    return [
        row([*PREFIX, 50, 51, 52, 7, 8, 9], 43),
        row([*PREFIX, 50, 60, 5, 6], 42),
        row([*PREFIX, 61, 62, 63, 10, 11, 12, 13, 14], 44),
        row([1, 2, 3, 4, 5, 6], 3),  # shares nothing
    ]


def reference(model, r, temperature=1.0):
    """Per-row plain forward: log-prob of each token given its prefix (from the model's own logits), on the mask."""
    logits = model(r.input_ids[None]).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, r.input_ids[1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1), lp]) * r.mask


def grads_of(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_every_row_once_budget_respected_and_prefix_shared():
    mbs = pack(rows(), max_tokens=60)
    assert sorted(n for mb in mbs for n in mb.row_lens) == sorted(len(r.input_ids) for r in rows())
    assert all(mb.num_tokens <= 60 or len(mb.row_lens) == 1 for mb in mbs)
    shared = [mb for mb in mbs if mb.prefix_len]
    assert shared and all(mb.prefix_len == 40 for mb in shared)  # stops at the first differing token
    assert sum(mb.num_tokens for mb in mbs) < sum(len(r.input_ids) for r in rows())


def test_a_shared_prefix_goes_past_trainable_tokens():
    """One row's sampled ids are another's prompt (a branch of an episode's tree, or two answers of a group that
    begin alike): computed once, the row that sampled them trains them."""
    a = row([*PREFIX, 1, 2], 20)
    b = row([*PREFIX, 3, 4], 41)
    (mb,) = pack([a, b], max_tokens=200, min_shared_prefix=8)
    assert mb.prefix_len == 40 and mb.num_tokens == 44
    assert pack([a, b], max_tokens=200, min_shared_prefix=41)[0].prefix_len == 0  # too short to pay


def test_a_row_shorter_than_the_bins_shared_prefix_joins_it():
    """Two rows share 40 tokens; a third is the first 20 of them and its own 5: the trie computes the 20 once
    for all three, the next 20 once for two, where a managed context's rows often land."""
    a, b = row([*PREFIX, 50, 51], 41), row([*PREFIX, 60, 61], 41)
    c = row([*PREFIX[:20], 70, 71, 72, 73, 74], 20)
    (mb,) = pack([a, b, c], max_tokens=200, min_shared_prefix=8)
    assert mb.prefix_len == 20 and sorted(mb.row_lens) == sorted(len(r.input_ids) for r in (a, b, c))
    assert mb.num_tokens == 42 + 2 + 5 and mb.shared == [0, 40, 20]


TREE = [  # an episode's tree: a main line, a branch off its sampled ids, a retry, a compaction
    row([*PREFIX, 50, 51, 52, 53], 40),
    row([*PREFIX, 50, 51, 52, 53, 44, 45, 46], 45),  # extends the first row's sampled ids, as prompt
    row([*PREFIX, 50, 51, 54, 55], 42),  # shares two of the first row's sampled ids
    row([*PREFIX[:30], 56, 57, 58], 30),
]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_row_an_earlier_row_holds_whole_computes_nothing_of_its_own(attention):
    """Two SFT rows alike, or a row that is another's prefix: no token of its own, its log-probs read from the
    other row's states."""
    model = tiny_model()
    model.config._attn_implementation = attention
    data = [TREE[0], row(TREE[0].input_ids.tolist(), 40), row(TREE[0].input_ids[:42].tolist(), 40)]
    (mb,) = pack(data, max_tokens=1000, min_shared_prefix=8)
    assert mb.num_tokens == len(TREE[0].input_ids)
    logp, _, _ = token_logprobs(model, mb)
    for (start, n), r in zip(mb.row_spans, mb.rows, strict=True):
        assert torch.allclose(logp[start : start + n], reference(model, r), atol=1e-5)


def test_a_tree_of_rows_computes_each_node_once_with_row_by_row_logprobs_and_gradients():
    model = tiny_model()
    ref_lp = [reference(model, r) for r in TREE]
    ref_grads = grads_of(model, -sum(lp.sum() for lp in ref_lp))
    (mb,) = pack(TREE, max_tokens=1000, min_shared_prefix=8)
    assert mb.num_tokens == 44 + 3 + 2 + 3  # the trie's nodes, against 59 tokens in the rows
    logp, _, states = token_logprobs(model, mb, hidden=True)
    for (start, n), r in zip(mb.row_spans, mb.rows, strict=True):
        expected = reference(model, next(x for x in TREE if x.input_ids.equal(r.input_ids)))
        assert torch.allclose(logp[start : start + n], expected, atol=1e-5)
        alone = model.model(r.input_ids[None]).last_hidden_state[0]  # every row's states, shared ones included
        assert torch.allclose(states[start : start + n], alone, atol=1e-5)
    got = grads_of(model, -logp.sum())
    for name, g in ref_grads.items():
        assert torch.allclose(got[name], g, atol=1e-5), name


def test_logprobs_and_gradients_match_rows_run_alone():
    model = tiny_model()
    data = rows()
    ref_lp = [reference(model, r) for r in data]
    ref_grads = grads_of(model, -sum(lp.sum() for lp in ref_lp))
    for budget, min_shared in ((1000, 32), (1000, 10_000), (40, 32)):  # shared prefix, packed only, one row per bin
        mbs = pack(data, max_tokens=budget, min_shared_prefix=min_shared)
        total = 0
        for mb in mbs:
            logp, _, _ = token_logprobs(model, mb)
            start = 0
            for n in mb.row_lens:
                r = next(r for r in data if len(r.input_ids) == n)
                assert torch.allclose(logp[start : start + n], reference(model, r), atol=1e-5)
                start += n
            total = total + logp.sum()
        got = grads_of(model, -total)
        for name, g in ref_grads.items():
            assert torch.allclose(got[name], g, atol=1e-5), (budget, min_shared, name)


def test_entropy_has_a_gradient_only_when_asked():
    model = tiny_model()
    (mb,) = pack(rows()[:1], max_tokens=1000)
    _, ent, _ = token_logprobs(model, mb, entropy=True)
    assert not ent.requires_grad
    _, ent, _ = token_logprobs(model, mb, entropy=True, entropy_grad=True)
    assert ent.requires_grad and float(ent.detach().sum()) > 0
    ent.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_weighted_loss_temperature_and_entropy_metric_match_plain_autograd():
    """The fused log-prob/entropy path against log_softmax + autograd, with per-token weights (like
    advantages) and a temperature."""
    model = tiny_model()
    r = rows()[0]
    weights = torch.linspace(-2.0, 3.0, len(r.input_ids)) * r.mask
    logits = model(r.input_ids[None]).logits[0, :-1] / 0.7
    logp_all = torch.log_softmax(logits, -1)
    ref_lp = torch.cat([torch.zeros(1), logp_all.gather(-1, r.input_ids[1:, None]).squeeze(-1)]) * r.mask
    ref_ent = torch.cat([torch.zeros(1), -(logp_all.exp() * logp_all).sum(-1)]) * r.mask
    ref_grads = grads_of(model, (ref_lp * weights).sum())
    (mb,) = pack([r], max_tokens=1000)
    logp, ent, _ = token_logprobs(model, mb, 0.7, entropy=True)
    assert torch.allclose(logp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent.detach(), atol=1e-5)
    got = grads_of(model, (logp * weights).sum())
    for name, g in ref_grads.items():
        assert torch.allclose(got[name], g, atol=1e-5), name


def enable_checkpointing(model):
    """transformers 5 renamed `gradient_checkpointing_enable` (now a deprecated alias)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_gives_the_same_logprobs_and_gradients_on_a_shared_prefix(lora):
    """Checkpointed layers recompute the one sequence (prefix once, then the suffixes under a 4D mask) in
    backward; the log-probs and gradients must not change."""
    data = rows()[:3]  # all share PREFIX
    (mb,) = pack(data, max_tokens=1000)
    assert mb.prefix_len == 40

    def run(checkpointing):
        model = tiny_model()
        if lora:
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(1)  # init_lora_weights=False: random A and B, so every adapter weight has a gradient
            config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
            model = get_peft_model(model, config)
        if checkpointing:
            enable_checkpointing(model)
        model.train()
        logp, _, _ = token_logprobs(model, mb)
        model.zero_grad()
        (-(logp * torch.linspace(-1.0, 2.0, len(logp))).sum()).backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    ref_lp, ref_grads = run(checkpointing=False)
    lp, grads = run(checkpointing=True)
    assert torch.allclose(lp, ref_lp, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert (grads[name] - g).norm() <= 1e-5 * g.norm() + 1e-12, name


TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    initializer_range=0.2,  # logits of a few units, so that soft-capping and scaling change them
)
LOGIT_MODELS = {  # model class: config that changes the logits after the LM head
    "Gemma2": lambda: transformers.Gemma2Config(**TINY, num_key_value_heads=2, head_dim=8, final_logit_softcapping=2.0),
    "Granite": lambda: transformers.GraniteConfig(**TINY, num_key_value_heads=2, logits_scaling=4.0),
    "Cohere": lambda: transformers.CohereConfig(**TINY, num_key_value_heads=2, logit_scale=3.0),
}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("name", list(LOGIT_MODELS))
def test_logprobs_follow_the_models_own_logit_processing(name, temperature):
    """Soft-capping (Gemma 2), logit scaling (Granite, Cohere) are applied after the
    projection, as in the model's forward: log-probs equal log_softmax(model(ids).logits / T)."""
    if not hasattr(transformers, f"{name}ForCausalLM"):
        pytest.skip(f"{name} is not in this transformers")
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(LOGIT_MODELS[name]()).eval()
    data = rows()
    mbs = pack(data, max_tokens=1000)
    assert any(mb.prefix_len for mb in mbs) and any(not mb.prefix_len for mb in mbs)  # both forward paths
    for mb in mbs:
        logp, _, _ = token_logprobs(model, mb, temperature)
        start = 0
        for n in mb.row_lens:
            r = next(r for r in data if len(r.input_ids) == n)
            assert torch.allclose(logp[start : start + n], reference(model, r, temperature), atol=1e-5), name
            start += n
    # the processing matters here: the bare projection gives different log-probs
    r = data[0]
    bare = model.get_output_embeddings()(model.get_decoder()(r.input_ids[None]).last_hidden_state)[0, :-1]
    bare_lp = torch.log_softmax(bare.float() / temperature, -1).gather(-1, r.input_ids[1:, None]).squeeze(-1)
    assert (bare_lp - reference(model, r, temperature)[1:]).mul(r.mask[1:]).abs().max() > 1e-2


@pytest.mark.parametrize(("attr", "value"), [("output_logit_soft_cap", 30.0), ("logits_scaling", 2.0)])
def test_an_unknown_logit_processing_is_refused_in_one_line(attr, value):
    """A config attribute that changes the logits in some model's forward, on a model type whose use
    of it is unknown, is refused before the forward runs rather than silently ignored."""
    model = tiny_model()
    setattr(model.config, attr, value)
    (mb,) = pack(rows()[:1], max_tokens=1000)
    with pytest.raises(ValueError, match=f"model type 'llama' sets {attr}=") as err:
        token_logprobs(model, mb)
    assert "\n" not in str(err.value)
    setattr(model.config, attr, None)
    token_logprobs(model, mb)  # unset: the plain path


def test_a_shared_prefix_runs_once_in_one_sequence_with_checkpointing_on_or_off(monkeypatch):
    """Rows sharing a prefix run as one sequence (their trie, depth first, no padding) in eval
    mode, while training, and while training with checkpointing (which would drop a KV cache); rows
    without one are packed."""
    import agent_r1.trainer.batching as batching

    calls = []
    for fn in ("_packed_forward", "_shared_forward"):
        original = getattr(batching, fn)
        monkeypatch.setattr(
            batching, fn, lambda m, mb, *rest, fn=fn, original=original: calls.append(fn) or original(m, mb, *rest)
        )
    (mb,) = pack(rows()[:3], max_tokens=1000)
    assert mb.prefix_len > 0
    model = tiny_model().train()
    token_logprobs(model, mb)
    enable_checkpointing(model)
    token_logprobs(model.eval(), mb)
    token_logprobs(model.train(), mb)
    token_logprobs(model, pack(rows()[:3], max_tokens=1000, min_shared_prefix=10**6)[0])
    assert calls == ["_shared_forward"] * 3 + ["_packed_forward"]


WINDOWED = {  # sliding windows shorter than the shared prefix: one mask for every layer, or one per layer type
    "Mistral": lambda: transformers.MistralConfig(**TINY, num_key_value_heads=2, sliding_window=6),
    "Gemma2": lambda: transformers.Gemma2Config(**TINY, num_key_value_heads=2, head_dim=8, sliding_window=6),
}


@pytest.mark.parametrize("name", list(WINDOWED))
def test_a_shared_prefix_keeps_the_models_sliding_windows(name):
    """The one sequence of a shared prefix and its suffixes is masked as the model masks each row alone:
    a suffix's window reaches back into the prefix by position (Mistral: every layer slides; Gemma 2:
    sliding and full layers alternate, on eager attention, whose mask is additive). Log-probs and
    gradients equal the rows' own forwards, and differ when the window is ignored."""
    torch.manual_seed(0)
    model = getattr(transformers, f"{name}ForCausalLM")(WINDOWED[name]()).train()
    data = rows()[:3]
    (mb,) = pack(data, max_tokens=1000)
    assert mb.prefix_len == 40
    ref = torch.cat([reference(model, r) for r in mb.rows])
    weights = torch.linspace(-1.0, 2.0, len(ref))
    ref_grads = grads_of(model, (ref * weights).sum())
    logp, _, _ = token_logprobs(model, mb)
    assert torch.allclose(logp, ref, atol=1e-5)
    for n, g in grads_of(model, (logp * weights).sum()).items():
        assert torch.allclose(g, ref_grads[n], atol=1e-5), n
    model.config.sliding_window = None  # the same sequence without windows: the answer changes
    assert not torch.allclose(token_logprobs(model, mb)[0], ref, atol=1e-3)


def test_attention_without_4d_masks_is_refused_in_one_line():
    model = tiny_model()
    model.config._attn_implementation = "flash_attention_2"
    (mb,) = pack(rows()[:3], max_tokens=1000)
    with pytest.raises(ValueError, match="attn_implementation='sdpa'") as err:
        token_logprobs(model, mb)
    assert "\n" not in str(err.value)


def test_a_run_is_cut_into_as_few_bins_as_filling_makes_but_even():
    """Eight rows sharing a 40-token prefix at a budget that fits seven: filling makes 7 + 1 rows, the
    balanced cut 4 + 4, computing the same tokens with the largest micro-batch 60% the size."""
    data = [row([*PREFIX, 50 + i, *range(10)], 41) for i in range(8)]  # 11 own tokens each
    budget = 40 + 7 * 11
    mbs = pack(data, max_tokens=budget)
    assert sorted(len(mb.rows) for mb in mbs) == [4, 4]
    assert all(mb.prefix_len == 40 and mb.num_tokens == 40 + 4 * 11 for mb in mbs)
    # a token less: filling makes 6 + 2, still two bins, so again 4 + 4
    assert [len(mb.rows) for mb in pack(data, max_tokens=budget - 1)] == [4, 4]
    assert len(pack(data, max_tokens=40 + 3 * 11)) == 3  # fewer rows fit: 3 bins of at most 3


def test_sdpa_keeps_one_float_mask_for_every_layer_with_the_booleans_results_to_the_bit(monkeypatch):
    """In fp32 on the CPU each row's tree mask goes to SDPA as the float mask SDPA would make of the booleans:
    one tensor per row held for backward by every layer instead of a copy per layer and row, with log-probs and
    gradients bitwise those of the boolean masks."""
    from agent_r1.models.tree_attention import Tree

    torch.manual_seed(0)
    model = tiny_model().train()
    (mb,) = pack(rows()[:3], max_tokens=1000)
    shapes = {tuple(m.shape) for m in mb.tree.masks}  # [1, 1, m, c + m] per row

    def run():
        masks = set()

        def pack_hook(t):
            if tuple(t.shape) in shapes and t.dtype in (torch.float32, torch.bool):
                masks.add(t.untyped_storage().data_ptr())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
            logp, _, _ = token_logprobs(model, mb)
        return logp, grads_of(model, (logp * torch.linspace(-1.0, 2.0, len(logp))).sum()), len(masks)

    logp, grads, held = run()
    monkeypatch.setattr(Tree, "additive", lambda self, dtype: self)  # the booleans, to SDPA as they are
    logp_b, grads_b, held_b = run()
    assert held == len(mb.rows) and held_b == len(mb.rows) * model.config.num_hidden_layers
    assert torch.equal(logp, logp_b)
    assert all(torch.equal(grads[n], g) for n, g in grads_b.items())
