"""Rows of steps sampled under a grammar: the trainer replays each step's grammar and computes the log-probs of
its tokens over the tokens the grammar allowed, equal to the engine's (the log-prob consistency check), packed
or as a trie, and no gradient reaches a token the grammar did not allow."""

from __future__ import annotations

import asyncio

import pytest

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.models.grammar import allowed, json_schema_grammar, model_grammars
from agent_r1.rollout.merge import merge_trajectory
from agent_r1.trainer.batching import pack, token_logprobs
from agent_r1.trainer.rows import build_rows, row_logprobs
from agent_r1.types import Step, Trajectory

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}, "tag": {"type": "string"}}, "required": ["x"]}


def episodes(model, tokenizer, n: int = 3) -> list[Trajectory]:
    """n one-step episodes from one prompt, the step sampled under a JSON-schema grammar by the engine."""
    engine = LocalEngine(model, tokenizer, seed=0, max_context=512)
    prompt = tokenizer.encode("Write one JSON object with an integer x and, if you like, a tag. " * 4)  # 64 tokens
    params = SamplingParams(max_new_tokens=60, temperature=1.3, seed=3, grammar=json_schema_grammar(SCHEMA))
    outs = asyncio.run(engine.generate([prompt] * n, params))
    engine.close()
    return [
        Trajectory({}, f"t{k}", "g", [Step(prompt, o.token_ids, o.logprobs, 1.0, text=o.text, grammar=params.grammar)])
        for k, o in enumerate(outs)
    ]


def rows_of(trajs, model, tokenizer):
    return build_rows(trajs, [merge_trajectory(t) for t in trajs], None, lambda: model_grammars(model, tokenizer))


@pytest.mark.parametrize("budget", [4096, 1], ids=["one-trie", "row-by-row"])
def test_the_trainers_logprobs_under_the_replayed_grammar_equal_the_engines(tiny_model, tokenizer, budget):
    trajs = episodes(tiny_model, tokenizer)
    rows, _ = rows_of(trajs, tiny_model, tokenizer)
    assert all(r.constrained is not None and len(r.constrained) == int(r.mask.sum()) for r in rows)
    assert (pack(rows, budget)[0].take is not None) == (budget > 1)  # one trie over the shared prompt, or none
    ours = row_logprobs(tiny_model, rows, budget, temperature=1.3)
    for row, logp in zip(rows, ours, strict=True):
        drift = ((logp - row.old_logp) * row.mask).abs().max()
        assert drift < 1e-4, drift
    # without the replayed masks the same rows are off by whole nats: the masks are what makes them equal
    for row in rows:
        row.constrained = row.allowed = None
    free = row_logprobs(tiny_model, rows, budget, temperature=1.3)
    assert max(((f - r.old_logp) * r.mask).abs().max() for f, r in zip(free, rows, strict=True)) > 0.5


def test_no_gradient_reaches_a_token_the_grammar_did_not_allow(tiny_model, tokenizer):
    trajs = episodes(tiny_model, tokenizer, n=1)
    rows, _ = rows_of(trajs, tiny_model, tokenizer)
    (mb,) = pack(rows, 4096)
    head = tiny_model.get_output_embeddings().weight
    tiny_model.zero_grad()
    logp, _, _ = token_logprobs(tiny_model, mb, 1.3)
    logp.sum().backward()
    # a token the grammar never allowed anywhere in the answer: its LM-head row gets no gradient
    ever = allowed(rows[0].allowed, head.shape[0]).any(0)  # [V]
    assert head.grad[~ever].abs().max() == 0.0 and head.grad[ever].abs().max() > 0
    tiny_model.zero_grad()


def test_a_step_its_grammar_refuses_stays_as_context_untrained(tiny_model, tokenizer):
    trajs = episodes(tiny_model, tokenizer, n=1)
    trajs[0].steps[0].grammar = 'root ::= "nothing like it"'
    rows, _ = rows_of(trajs, tiny_model, tokenizer)
    assert rows[0].mask.sum() == 0 and rows[0].constrained is None
