"""Grammar-constrained sampling: which tokens a grammar allows next, for the engine and for the trainer.

Where an API promises structure (a forced tool call, `response_format: json_schema`), the answer is sampled
under a grammar, as vLLM does it: before each token, every token the grammar cannot take next gets logit
-inf (xgrammar's token bitmask, Dong et al. 2024, "XGrammar"), so the answer always parses. A grammar is one
EBNF text (xgrammar's dialect, what vLLM's `structured_outputs.grammar` takes), so a step records it as a
string and any engine can be given it.

The mask changes the distribution the token was sampled from: its log-prob is the log-softmax over the
allowed tokens alone. The trainer must compute the same quantity, or the importance ratio compares two
different distributions and the log-prob consistency check fails on every constrained token. So a step
keeps its grammar, and the trainer replays it over the sampled ids to get the mask before each one
(`Grammars.masks`): the matcher's state depends only on the tokens accepted, so the replay gives the engine's
masks exactly, at the cost of a few microseconds a token, instead of storing 6 KB of bitmask per token.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from agent_r1.models.loading import eos_token_ids

if TYPE_CHECKING:
    import xgrammar as xgr


@functools.cache
def _xgr() -> Any:
    """xgrammar, imported at the first grammar (it adds ~0.6 s to a process's start)."""
    return importlib.import_module("xgrammar")


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """The EBNF of JSON text matching `schema` (any JSON object for None, OpenAI's `json_object`), written
    compactly as `json.dumps` writes it: free whitespace lets a small model pad with newlines until
    `max_tokens`, and the compact form is what chat templates show the model. An object takes only the
    properties its schema names unless it says otherwise (OpenAI's strict structured outputs)."""
    try:
        if schema is None:
            return str(_xgr().Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False))
        return str(_xgr().Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True))
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar raises RuntimeError for what it cannot read
        raise ValueError(f"unsupported JSON schema: {_reason(exc)}") from None


def check_grammar(grammar: str) -> None:
    """A one-line ValueError if `grammar` is not EBNF that xgrammar reads (a client's own grammar)."""
    try:
        _xgr().Grammar.from_ebnf(grammar)
    except RuntimeError as exc:
        raise ValueError(f"grammar is not valid EBNF: {_reason(exc)}") from None


def _reason(exc: Exception) -> str:
    """xgrammar's message without its time stamp and C++ source location."""
    text = str(exc).strip("'\"").splitlines()[0] if str(exc) else type(exc).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)


def literal(text: str) -> str:
    """The EBNF of exactly `text`."""
    return f"root ::= {json.dumps(text)}"


def concat(*parts: str) -> str:
    """The EBNF of the parts one after another."""
    return str(_xgr().Grammar.concat(*(_xgr().Grammar.from_ebnf(p) for p in parts)))


def union(*choices: str) -> str:
    """The EBNF of any one of the choices."""
    return (
        choices[0] if len(choices) == 1 else str(_xgr().Grammar.union(*(_xgr().Grammar.from_ebnf(c) for c in choices)))
    )


class Grammars:
    """Compiled grammars for one tokenizer and vocabulary (the model's logits width), cached by their text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_ids: set[int] | list[int]) -> None:
        self.vocab_size = vocab_size
        # the stop ids are the model's EOS ids: a finished grammar allows only them
        info = _xgr().TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))
        self._compiler = _xgr().GrammarCompiler(info, max_threads=1)
        self._compiled = functools.lru_cache(maxsize=256)(self._compiler.compile_grammar)

    def matcher(self, grammar: str) -> xgr.GrammarMatcher:
        """A fresh matcher at the grammar's start; a grammar that does not compile is a one-line ValueError."""
        check_grammar(grammar)
        return _xgr().GrammarMatcher(self._compiled(grammar))

    def bitmask(self, rows: int = 1) -> torch.Tensor:
        """An empty int32 bitmask [rows, ceil(V / 32)] for `fill`."""
        return _xgr().allocate_token_bitmask(rows, self.vocab_size)

    def apply(self, logits: torch.Tensor, matchers: dict[int, xgr.GrammarMatcher]) -> None:
        """Set to -inf, in place, the logits [b, V] of every token row i's matcher does not allow next."""
        bits = self.bitmask(len(logits))
        for i, m in matchers.items():
            m.fill_next_token_bitmask(bits, i)
        _xgr().apply_token_bitmask_inplace(
            logits, bits.to(logits.device), vocab_size=self.vocab_size, indices=list(matchers)
        )

    def masks(self, grammar: str, token_ids: list[int]) -> torch.Tensor:
        """The bitmask before each of `token_ids` [R, ceil(V / 32)] (int32), replaying the grammar over them;
        a ValueError if the grammar never allowed one of them (the ids were not sampled under it)."""
        m = self.matcher(grammar)
        out = self.bitmask(len(token_ids))
        for i, token in enumerate(token_ids):
            m.fill_next_token_bitmask(out, i)
            if not m.accept_token(token):
                raise ValueError(f"token {token} at position {i} is not allowed by the step's grammar")
        return out


def allowed(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask [..., W] int32 -> bool [..., vocab_size]: True where the token may come next."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    unpacked = ((bits.unsqueeze(-1) >> shifts) & 1).flatten(-2).bool()  # [..., 32 W]
    if unpacked.shape[-1] < vocab_size:  # logits wider than the grammar's vocabulary: padding ids, never allowed
        return torch.nn.functional.pad(unpacked, (0, vocab_size - unpacked.shape[-1]))
    return unpacked[..., :vocab_size]


def model_grammars(model: Any, tokenizer: PreTrainedTokenizerBase) -> Grammars:
    """The grammars of `model`'s logits (its config's vocabulary, EOS ids from its generation config): the
    engine masks with them and the trainer replays them, so the two compute the same masks."""
    vocab = int(model.config.get_text_config().vocab_size)
    return _grammars(tokenizer, vocab, tuple(sorted(eos_token_ids(model, tokenizer))))


@functools.lru_cache(maxsize=8)
def _grammars(tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_ids: tuple[int, ...]) -> Grammars:
    """One `Grammars` per tokenizer and vocabulary in a process (building the token table takes ~0.1 s)."""
    return Grammars(tokenizer, vocab_size, set(stop_ids))
