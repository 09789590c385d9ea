"""`TextStream`: sampled token ids in, text deltas out, for streaming to a terminal or an SSE client.

Decoding each token on its own breaks characters that span several tokens (UTF-8 pieces of an emoji)
and tokenizers whose spaces depend on the neighbouring token, so the whole response is decoded every
time and only the new suffix is emitted; a trailing U+FFFD (half a character) is held back until the
rest arrives. EOS ids are not shown, matching `GenerateOutput.text`.
"""

from __future__ import annotations

from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase


class TextStream:
    """Incremental detokenizer for one response; shows text only up to the first marker (a stop
    string, the start of a tool call) and never shows anything it may have to take back."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, hidden_ids: Iterable[int] = (), markers: Iterable[str] = ()
    ) -> None:
        self.tokenizer = tokenizer
        self.hidden_ids = set(hidden_ids)
        self.markers = tuple(markers)
        self.ids: list[int] = []
        self.text = ""  # the decoded response so far (whole characters only)
        self.shown = ""  # what push/finish have returned so far

    def push(self, token_id: int) -> str:
        """Add one sampled token; return the newly visible text ("" while a character is split)."""
        if token_id not in self.hidden_ids:
            self.ids.append(token_id)
            text = self.tokenizer.decode(self.ids, skip_special_tokens=False)
            if not text.endswith("\ufffd"):
                self.text = text
        return self._show(visible_prefix(self.text, self.markers, final=False))

    def finish(self, final: str | None = None) -> str:
        """The rest once the response is complete; `final` replaces the default visible text (for
        example the whole text, when what looked like a tool call turned out not to be one)."""
        return self._show(visible_prefix(self.text, self.markers, final=True) if final is None else final)

    def _show(self, shown: str) -> str:
        if not shown.startswith(self.shown):
            return ""
        delta, self.shown = shown[len(self.shown) :], shown
        return delta


def visible_prefix(text: str, markers: Iterable[str], final: bool) -> str:
    """`text` up to the first marker (a stop string, the start of a tool call), safe to show while
    the text still grows: until it is `final`, a tail that may be the start of a marker is held back,
    so nothing shown ever has to be taken back."""
    markers = [m for m in markers if m]
    cut = min((i for m in markers if (i := text.find(m)) >= 0), default=len(text))
    text = text[:cut]
    if not final:
        for k in range(min(max((len(m) for m in markers), default=1) - 1, len(text)), 0, -1):
            if any(m.startswith(text[-k:]) for m in markers):
                return text[:-k]
    return text
