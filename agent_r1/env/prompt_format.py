"""Prompt formats turn messages into token ids, once, as they enter the context.

Two formats: `ChatFormat` (the model's own chat template) and `TextFormat` (plain text for base
models, which have no template). Both render a first prompt from messages and, later, the
*continuation* ids that close the sampled assistant turn, add the env's messages (tool results) and
open the next assistant turn. Sampled ids are never re-rendered, so nothing drifts.
"""

from __future__ import annotations

from typing import Protocol

from transformers import PreTrainedTokenizerBase

from agent_r1.types import Message

_MARK = "\u2063AGENT_R1_CONTENT\u2063"  # a string no template or model produces


class PromptFormat(Protocol):
    stop: tuple[str, ...]  # stop strings the format needs (a base model would write the next turn)

    def initial(self, messages: list[Message]) -> list[int]:
        """Ids of a whole conversation, ending with the opening of an assistant turn."""
        ...

    def continuation(self, messages: list[Message], after_eos: bool) -> list[int]:
        """Ids to append after a sampled assistant response: close it, add `messages`, reopen."""
        ...


class ChatFormat:
    """The tokenizer's chat template. The continuation is found by rendering a probe conversation
    and cutting right after the assistant content, so it works for any template (ChatML, Llama, ...).
    """

    stop: tuple[str, ...] = ()

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not tokenizer.chat_template:
            raise ValueError("tokenizer has no chat template: use TextFormat for base models")
        self.tokenizer = tokenizer

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def initial(self, messages: list[Message]) -> list[int]:
        return self._encode(self._render(messages, generation_prompt=True))

    def continuation(self, messages: list[Message], after_eos: bool) -> list[int]:
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
        text = self._render(probe + messages, generation_prompt=True)
        delta = text[text.index(_MARK) + len(_MARK) :]
        eos = self.tokenizer.eos_token or ""
        if after_eos and eos and delta.startswith(eos):  # the model already sampled the end-of-turn token
            delta = delta[len(eos) :]
        return self._encode(delta)


class TextFormat:
    """Plain text for base models: `System\\n\\nUser: ...\\nAssistant: ...` turns."""

    stop: tuple[str, ...] = ("\nUser:",)

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def _turns(self, messages: list[Message]) -> str:
        out = []
        for m in messages:
            if m["role"] == "system":
                out.append(m["content"].strip() + "\n\n")
            elif m["role"] == "assistant":
                out.append(f" {m['content'].strip()}\n")
            else:
                out.append(f"User: {m['content'].strip()}\nAssistant:")
        return "".join(out)

    def initial(self, messages: list[Message]) -> list[int]:
        text = self._turns(messages)
        if not text.endswith("Assistant:"):
            text += "Assistant:"
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        return bos + self.tokenizer.encode(text, add_special_tokens=False)

    def continuation(self, messages: list[Message], after_eos: bool) -> list[int]:
        return self.tokenizer.encode("\n" + self._turns(messages), add_special_tokens=False)


def prompt_format_for(tokenizer: PreTrainedTokenizerBase, chat: bool | None = None) -> PromptFormat:
    """ChatFormat when the model has a chat template (or `chat=True`), else TextFormat."""
    use_chat = bool(tokenizer.chat_template) if chat is None else chat
    return ChatFormat(tokenizer) if use_chat else TextFormat(tokenizer)
