"""Prompt formats turn messages into token ids, once, as they enter the context.

Two formats: `ChatFormat` (the model's own chat template) and `TextFormat` (plain text for base
models, which have no template). Both render a first prompt from messages and, later, the
*continuation* ids that close the sampled assistant turn, add the env's messages (tool results) and
open the next assistant turn. Sampled ids are never re-rendered, so nothing drifts.

Messages may hold images (OpenAI-style content parts). A `ChatFormat` given the model's `ImageEncoder`
expands each image's placeholder ids as the image enters the context, exactly once, and `images(...)`
lists the images those ids stand for; every other format shows a text-only model a note where an
image was, so it is told rather than crashed.
"""

from __future__ import annotations

import copy
import functools
import weakref
from typing import Any, Protocol

import jinja2
import jinja2.meta
from transformers import PreTrainedTokenizerBase

from agent_r1.env.tool_formats import ToolFormat, tool_format
from agent_r1.models.vision import ImageEncoder, image_parts, text_only
from agent_r1.types import Image, Message

_MARK = "\u2063AGENT_R1_CONTENT\u2063"  # a string no template or model produces
_ENCODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # processor -> its ImageEncoder
NO_VISION = "[an image: this model reads text only]"  # what a text-only model sees for an image


class PromptFormat(Protocol):
    stop: tuple[str, ...]  # stop strings the format needs (a base model would write the next turn)
    tool_format: ToolFormat  # how the model writes tool calls (agent_r1.env.tool_formats)
    native_tools: bool  # the chat template renders the tools and their results itself (`with_tools`)

    def initial(self, messages: list[Message]) -> list[int]:
        """Ids of a whole conversation, ending with the opening of an assistant turn."""
        ...

    def continuation(self, messages: list[Message], after_eos: bool) -> list[int]:
        """Ids to append after a sampled assistant response: close it, add `messages`, reopen."""
        ...

    def images(self, messages: list[Message]) -> list[Image]:
        """The images whose placeholders `initial` / `continuation` put in the ids of `messages`, in
        order (none for a text-only model). A source that cannot be read is a one-line ValueError."""
        ...


class ChatFormat:
    """The tokenizer's chat template. The continuation is found by rendering a probe conversation
    and cutting right after the assistant content, so it works for any template (ChatML, Llama, ...).

    With `images` (a vision-language model's `ImageEncoder`), the processor's chat template renders an
    image part as the image token, and each image token becomes that image's expansion.
    """

    stop: tuple[str, ...] = ()

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, images: ImageEncoder | None = None, tool_format_name: str = "auto"
    ) -> None:
        self.template = images.chat_template if images is not None else tokenizer.chat_template
        if not self.template:
            raise ValueError("tokenizer has no chat template: use TextFormat for base models")
        self.tokenizer = tokenizer
        self.encoder = images
        self.tool_format = tool_format(self.template, tool_format_name)
        # the template renders a `tools` list itself (Qwen, Llama 3, Mistral, gpt-oss, ...): `with_tools`
        self.native_tools = _renders_tools(self.template)
        self.tools: list[dict[str, Any]] | None = None

    def with_tools(self, schemas: list[dict[str, Any]]) -> ChatFormat:
        """This format with the tools rendered by the template in every prompt it makes (the system
        prompt or first user turn the model was trained with), as `apply_chat_template(tools=...)`."""
        out = copy.copy(self)
        out.tools = list(schemas)  # OpenAI-style: {"type": "function", "function": {...}} (Tool.schema)
        return out

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        messages = [self._prepare(m) for m in messages]
        return self.tokenizer.apply_chat_template(
            messages, chat_template=self.template, add_generation_prompt=generation_prompt, tokenize=False,
            tools=self.tools,
        )  # fmt: skip

    def _prepare(self, message: Message) -> Message:
        """A text-only model gets a note for each image; a VLM gets its image token out of text parts
        (a tool printing "<image>" must not make a placeholder without an image)."""
        if self.encoder is None:
            return text_only(message, NO_VISION)
        token = self.encoder.image_token

        def clean(text: Any) -> Any:
            return text.replace(token, token[:1] + " " + token[1:]) if isinstance(text, str) else text

        content = message.get("content")
        if isinstance(content, list):
            content = [{**p, "text": clean(p["text"])} if p.get("type") == "text" else p for p in content]
        return {**message, "content": clean(content)}

    def _encode(self, text: str, images: list[Image]) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if self.encoder is None:
            return ids
        token, out, it = self.encoder.image_token_id, [], iter(images)
        for t in ids:
            image = next(it, None) if t == token else None
            if t == token and image is None:
                raise ValueError("the chat template rendered more image tokens than the messages have images")
            out += image.expansion if image is not None else [t]
        if next(it, None) is not None:
            raise ValueError("the chat template rendered fewer image tokens than the messages have images")
        return out

    def images(self, messages: list[Message]) -> list[Image]:
        if self.encoder is None:
            return []
        return [self.encoder.encode(source) for m in messages for source in image_parts(m)]

    def initial(self, messages: list[Message]) -> list[int]:
        return self._encode(self._render(messages, generation_prompt=True), self.images(messages))

    def continuation(self, messages: list[Message], after_eos: bool) -> list[int]:
        try:
            probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}]
            text = self._render(probe + messages, generation_prompt=True)
        except jinja2.TemplateError:  # gpt-oss: a tool result must follow an assistant turn that called it
            name = next((m.get("name") for m in messages if m["role"] == "tool"), None)
            if name is None:
                raise
            call = {"type": "function", "function": {"name": name, "arguments": _MARK}}
            probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
            text = self._render(probe + messages, generation_prompt=True)
        delta = text[text.index(_MARK) + len(_MARK) :]
        eos = self.tokenizer.eos_token or ""
        if after_eos and eos and delta.startswith(eos):  # the model already sampled the end-of-turn token
            delta = delta[len(eos) :]
        for end in self.tool_format.stop:  # a call turn ends with its stop string, which the model wrote
            delta = delta.removeprefix(end)
        return self._encode(delta, self.images(messages))


@functools.cache
def _renders_tools(template: str) -> bool:
    """Whether a chat template reads a `tools` variable (parsed once per template: formats are made per
    episode)."""
    return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))


class TextFormat:
    """Plain text for base models: `System\\n\\nUser: ...\\nAssistant: ...` turns."""

    stop: tuple[str, ...] = ("\nUser:",)
    native_tools = False

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tool_format_name: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.tool_format = tool_format(None, tool_format_name)  # auto: hermes (a base model has no format)

    def images(self, messages: list[Message]) -> list[Image]:
        return []  # base models here read text only: an image is a note (NO_VISION)

    def _turns(self, messages: list[Message]) -> str:
        out = []
        for m in (text_only(m, NO_VISION) for m in messages):
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


def prompt_format_for(tokenizer: Any, chat: bool | None = None, tool_format_name: str = "auto") -> PromptFormat:
    """ChatFormat when the model has a chat template (or `chat=True`), else TextFormat. `tokenizer` may
    be a vision-language model's processor (`load_processor`): then the ChatFormat reads images.
    `tool_format_name`: the tool-call family, "auto" for the template's own."""
    images = None
    if getattr(tokenizer, "image_processor", None) is not None:  # a processor: its tokenizer and images
        if (images := _ENCODERS.get(tokenizer)) is None:  # one per processor: its prepared images are kept
            images = _ENCODERS[tokenizer] = ImageEncoder(tokenizer)
        tokenizer = tokenizer.tokenizer
    use_chat = bool((images and images.chat_template) or tokenizer.chat_template) if chat is None else chat
    return ChatFormat(tokenizer, images, tool_format_name) if use_chat else TextFormat(tokenizer, tool_format_name)
