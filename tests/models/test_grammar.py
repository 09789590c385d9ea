"""Grammar-constrained sampling: the masks a grammar gives, the engine's answers under one (always valid, their
log-probs over the allowed tokens), and the trainer's replay of the same masks."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
import torch

from agent_r1.engines.cpu.local_engine import LocalEngine
from agent_r1.engines.protocol import SamplingParams
from agent_r1.models.grammar import allowed, check_grammar, json_schema_grammar, model_grammars

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def test_the_mask_before_the_first_token_is_every_token_that_starts_the_language(tiny_model, tokenizer):
    grammars = model_grammars(tiny_model, tokenizer)
    bits = grammars.masks('root ::= "yes" | "no"', tokenizer.encode("yes", add_special_tokens=False))
    first = allowed(bits[0], grammars.vocab_size)  # [V]
    # by hand: a token may come first when its text is a non-empty prefix of one of the two words
    pieces = [tokenizer.decode([i]) for i in range(len(tokenizer))]
    expected = {i for i, p in enumerate(pieces) if p and ("yes".startswith(p) or "no".startswith(p))}
    assert set(first.nonzero().squeeze(-1).tolist()) == expected and len(expected) >= 3
    with pytest.raises(ValueError, match="is not allowed by the step's grammar"):
        grammars.masks('root ::= "yes" | "no"', tokenizer.encode("maybe", add_special_tokens=False))


def test_json_object_takes_any_object_and_nothing_else(tiny_model, tokenizer):
    grammars, grammar = model_grammars(tiny_model, tokenizer), json_schema_grammar(None)
    ids = tokenizer.encode('{"a": [1, {"b": null}], "c": "d"}', add_special_tokens=False)
    grammars.masks(grammar, [*ids, tokenizer.eos_token_id])
    for not_an_object in ("[1, 2]", '"text"', '{"a" 1}', "{} {}"):
        ids = tokenizer.encode(not_an_object, add_special_tokens=False)
        with pytest.raises(ValueError, match="is not allowed"):
            grammars.masks(grammar, [*ids, tokenizer.eos_token_id])


def test_bad_grammars_and_schemas_are_one_line_errors():
    with pytest.raises(ValueError, match=r'^grammar is not valid EBNF: .*Rule "nowhere" is not defined$'):
        check_grammar("root ::= nowhere")
    with pytest.raises(ValueError, match=r'^unsupported JSON schema: .*"nonsense"'):
        json_schema_grammar({"type": "object", "properties": {"a": {"type": "nonsense"}}})


def test_answers_sampled_under_a_json_schema_parse_and_their_logprobs_are_over_the_allowed_tokens(
    tiny_model, tokenizer
):
    """A random tiny model at temperature 1.5 writes noise unconstrained; under the schema's grammar every
    answer is JSON the schema accepts, and each token's log-prob is z - logsumexp(z over the allowed)."""
    engine = LocalEngine(tiny_model, tokenizer, seed=0, max_context=512)
    prompt = tokenizer.encode("Describe a person:")
    grammar = json_schema_grammar(PERSON)
    params = SamplingParams(max_new_tokens=120, temperature=1.5, seed=7, grammar=grammar)
    outs = asyncio.run(engine.generate([prompt] * 4, params))
    free = asyncio.run(engine.generate([prompt], SamplingParams(max_new_tokens=20, temperature=1.5, seed=7)))
    with pytest.raises(json.JSONDecodeError):
        json.loads(free[0].text)
    grammars = model_grammars(tiny_model, tokenizer)
    for out in outs:
        assert out.finish_reason == "eos", out.text  # the grammar ended, then only EOS was allowed
        jsonschema.validate(json.loads(out.text), PERSON)
        ids = torch.tensor(prompt + out.token_ids)
        with torch.no_grad():
            z = tiny_model(ids[None]).logits[0, len(prompt) - 1 : -1].float() / 1.5  # [R, V]
        ok = allowed(grammars.masks(grammar, out.token_ids), z.shape[-1])  # [R, V]
        expected = z.gather(-1, ids[len(prompt) :, None]).squeeze(-1) - z.masked_fill(~ok, -torch.inf).logsumexp(-1)
        assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)
        unmasked = z.gather(-1, ids[len(prompt) :, None]).squeeze(-1) - z.logsumexp(-1)
        assert (torch.tensor(out.logprobs) - unmasked).max() > 0.5  # the mask moved them: not a no-op
    engine.close()


def test_a_grammar_that_does_not_compile_fails_the_call(engine, tokenizer):
    with pytest.raises(ValueError, match="grammar is not valid EBNF"):
        asyncio.run(engine.generate([tokenizer.encode("hi")], SamplingParams(grammar='root ::= "a')))
