"""Images for vision-language models: read, prepared by the model's processor, embedded by its tower.

A VLM's prompt holds placeholder ids (its image token) where an image sits; the vision tower turns the
image into as many feature vectors, which replace those placeholders' embeddings before the language
model runs (LLaVA, Liu et al. 2023; Qwen2-VL, Wang et al. 2024; Idefics3). agent-r1 keeps prompts as
exact ids, so an image travels beside its prompt as an `Image` (agent_r1/types.py): the processor's
tensors for it, how many placeholders it takes, and a digest of its pixels. The images of a prompt are
listed in the order of their placeholders, so the k-th run of placeholders is the k-th image; nothing
else (offsets, spans) needs to be stored, and any cut of a prompt knows its images by counting.

Placeholders are the same id for every image, so wherever prompts are compared (a GRPO group prefilled
once, a parked KV slot continued, a shared prefix in a training micro-batch, two steps merged into one
row) they are compared as `keys`: the ids with each placeholder replaced by its image's digest.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agent_r1.types import Image, Message

IMAGE_PARTS = ("image", "image_url")  # content-part types that hold an image (ours, OpenAI's)
_TEXT_INPUTS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")  # not the image's


def read_image(source: Any) -> Any:
    """`source` as an RGB PIL image: a PIL image, an array [H, W] or [H, W, 3] (uint8, or floats in
    [0, 1]), a file path, a `data:image/...;base64,` URL or raw bytes. Anything unreadable is a one-line
    ValueError saying what it was."""
    from PIL import Image as PILImage

    try:
        if isinstance(source, PILImage.Image):
            picture = source
        elif isinstance(source, np.ndarray):
            array = source if source.dtype == np.uint8 else (np.clip(source, 0, 1) * 255).round().astype(np.uint8)
            picture = PILImage.fromarray(array)
        elif isinstance(source, bytes):
            picture = PILImage.open(io.BytesIO(source))
        elif isinstance(source, str) and source.startswith("data:"):
            picture = PILImage.open(io.BytesIO(base64.b64decode(source.split(",", 1)[1], validate=True)))
        elif isinstance(source, str | Path):
            picture = PILImage.open(Path(source).expanduser())
        else:
            raise ValueError(f"unsupported image type {type(source).__name__}")
        picture.load()  # decode now: a truncated file fails here, not inside the processor
        return picture.convert("RGB")
    except (OSError, ValueError, TypeError, IndexError) as exc:  # PIL's UnidentifiedImageError is an OSError
        what = repr(str(source)[:40]) if isinstance(source, str | Path) else type(source).__name__
        raise ValueError(f"cannot read image {what}: {type(exc).__name__}: {exc}".splitlines()[0][:300]) from None


def png_data_url(source: Any, max_side: int | None = None) -> str:
    """`source` (anything `read_image` takes) as a PNG `data:` URL, at most `max_side` pixels a side when
    given (aspect kept): how images travel in JSON (tasks, trajectory records, API requests)."""
    picture = read_image(source)
    if max_side is not None:
        picture.thumbnail((max_side, max_side))
    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_parts(message: Message) -> list[Any]:
    """The image sources of a message's content parts, in order (none for a string content)."""
    content = message.get("content")
    if not isinstance(content, list):
        return []
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            out.append(part.get("image", part.get("url")))
        elif kind == "image_url":
            url = part.get("image_url")
            out.append(url.get("url") if isinstance(url, dict) else url)
    return out


def text_only(message: Message, note: str = "[image]") -> Message:
    """`message` with its content parts joined into one string, each image replaced by `note`: what a
    text-only model is shown (it cannot see the image, and is told so)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    text = "".join(
        str(p.get("text", "")) if p.get("type") == "text" else note if p.get("type") in IMAGE_PARTS else ""
        for p in content
        if isinstance(p, dict)
    )
    return {**message, "content": text}


class ImageEncoder:
    """A model's processor, one image at a time: `encode(source) -> Image`.

    Each image is prepared on its own (`processor(text=<image token>, images=[image])`), which gives its
    tensors and the exact ids its one image token expands to, so a prompt's images can be expanded as
    they enter the context and never again. Prepared images are kept by digest (an LRU of `cache`): a
    GRPO group and every later turn of an episode show the same picture.
    """

    def __init__(self, processor: Any, cache: int = 512) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_token: str = processor.image_token
        self.image_token_id: int = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self._cache: collections.OrderedDict[str, Image] = collections.OrderedDict()
        self._size = cache

    @property
    def chat_template(self) -> str | None:
        return getattr(self.processor, "chat_template", None) or self.tokenizer.chat_template

    def encode(self, source: Any) -> Image:
        picture = read_image(source)
        digest = hashlib.sha256(f"{picture.size}".encode() + picture.tobytes()).hexdigest()
        if (hit := self._cache.get(digest)) is not None:
            self._cache.move_to_end(digest)
            return hit
        out = self.processor(text=self.image_token, images=[picture], return_tensors="pt", add_special_tokens=False)
        expansion = out["input_ids"][0].tolist()
        inputs = {k: v for k, v in out.items() if k not in _TEXT_INPUTS and isinstance(v, torch.Tensor)}
        image = Image(digest, inputs, expansion.count(self.image_token_id), expansion, picture)
        self._cache[digest] = image
        if len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return image


def image_token_id(model: torch.nn.Module) -> int | None:
    """The placeholder id of a vision-language model (None for a text-only one)."""
    config = model.config
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def placeholder_keys(ids: Sequence[int], images: Sequence[Image], token_id: int | None) -> list[int]:
    """`ids` with each image's placeholders replaced by a negative key derived from its digest: equal
    keys mean equal prompts, pixels included (vLLM hashes multi-modal prompts alike). Returns `ids` as
    a list when there are no images."""
    if not images:
        return list(ids)
    keys, it, left, key = list(ids), iter(images), 0, 0
    for i, t in enumerate(keys):
        if t != token_id:
            continue
        if left == 0:
            image = next(it, None)
            if image is None:
                raise ValueError("the prompt has more image placeholders than images")
            left, key = image.num_tokens, -1 - int(image.digest[:15], 16)
        keys[i], left = key, left - 1
    return keys


def count_placeholders(ids: Sequence[int] | torch.Tensor, token_id: int | None) -> int:
    """How many image placeholders `ids` hold (0 for a text-only model)."""
    if token_id is None:
        return 0
    if isinstance(ids, torch.Tensor):
        return int((ids == token_id).sum())
    return sum(1 for t in ids if t == token_id)


def check_images(ids: Sequence[int], images: Sequence[Image], token_id: int | None) -> None:
    """A one-line ValueError unless the prompt's placeholders are exactly its images' (a text-only model
    given images, an image token sampled by the model, a prompt cut inside an image)."""
    want = sum(i.num_tokens for i in images)
    if images and token_id is None:
        raise ValueError(f"the prompt has {len(images)} image(s) but the model reads text only")
    have = count_placeholders(ids, token_id)
    if have != want:
        raise ValueError(f"the prompt has {have} image placeholder ids but its {len(images)} image(s) need {want}")


def image_features(model: torch.nn.Module, images: Sequence[Image]) -> list[torch.Tensor]:
    """Each image's features [n_i, H] from the model's vision tower and projector, images of one shape
    in one batch, each distinct image once (by digest)."""
    unique = list({i.digest: i for i in images}.values())
    by_shape: dict[tuple, list[Image]] = {}
    for image in unique:
        by_shape.setdefault(tuple((k, tuple(v.shape)) for k, v in sorted(image.inputs.items())), []).append(image)
    device = next(model.parameters()).device
    feats: dict[str, torch.Tensor] = {}
    for batch in by_shape.values():
        inputs = {k: torch.cat([i.inputs[k] for i in batch]).to(device) for k in batch[0].inputs}
        out = model.get_image_features(**inputs)
        pooled = getattr(out, "pooler_output", out)
        parts = list(pooled) if isinstance(pooled, list | tuple) or pooled.dim() == 3 else [pooled]
        if len(parts) != len(batch):  # one flat [sum n_i, H] (some towers): split by placeholder counts
            parts = list(torch.cat(parts).split([i.num_tokens for i in batch]))
        for image, f in zip(batch, parts, strict=True):
            if f.shape[0] != image.num_tokens:
                got = f"{f.shape[0]} features for an image of {image.num_tokens} placeholders"
                raise ValueError(f"the vision tower gave {got}")
            feats[image.digest] = f
    return [feats[i.digest] for i in images]


def embed_with_images(
    model: torch.nn.Module, ids: torch.Tensor, images: Sequence[Image], token_id: int | None, skip: int = 0
) -> torch.Tensor:
    """Input embeddings [..., H] of `ids` [...] with the images' features in their placeholders.

    `ids` may be a cut of the prompt that starts after `skip` of its placeholders (a prefill continuing
    a cached context): only the images it overlaps run through the tower, and a cut inside an image
    takes the matching rows of its features.
    """
    embeds = model.get_input_embeddings()(ids)
    slots = ids == token_id if token_id is not None else None
    count = int(slots.sum()) if slots is not None else 0
    if count == 0:
        return embeds
    needed, start = [], 0  # the images overlapping placeholders [skip, skip + count)
    for image in images:
        end = start + image.num_tokens
        if end > skip and start < skip + count:
            needed.append((image, start))
        start = end
    if start < skip + count:
        raise ValueError(f"the prompt has {skip + count} image placeholder ids but its images fill {start}")
    feats = torch.cat(image_features(model, [i for i, _ in needed]))  # [sum n_i, H]
    first = skip - needed[0][1]
    rows = feats[first : first + count].to(embeds.dtype)
    return embeds.masked_scatter(slots[..., None], rows)


def rope_index(model: torch.nn.Module) -> Any:
    """The model's own function for multi-dimensional rotary positions (the Qwen2-VL family's mrope,
    `get_rope_index`), or None for a model whose positions are token indices."""
    for module in model.modules():
        fn = getattr(module, "get_rope_index", None)
        if callable(fn):
            return fn
    return None


def rope_positions(fn: Any, ids: Sequence[int] | torch.Tensor, images: Sequence[Image], token_id: int) -> torch.Tensor:
    """Positions [3, T] of a whole prompt or row from the model's `get_rope_index` (Qwen2-VL, Wang et al.
    2024: an image's tokens take (time, row, column) positions, and the text after it continues from
    its largest one). Always from the whole sequence: a token's position does not depend on what
    follows it, but `get_rope_index` cannot start inside an image."""
    t = torch.as_tensor(ids).reshape(1, -1)
    grid = torch.cat([i.inputs["image_grid_thw"] for i in images]).to(t.device) if images else None
    types = (t == token_id).int()  # 1 on image placeholders, 0 on text
    positions, _ = fn(input_ids=t, mm_token_type_ids=types, image_grid_thw=grid, attention_mask=torch.ones_like(t))
    return positions[:, 0]  # [3, T]


VISION_MODULES = ("vision_tower", "multi_modal_projector", "visual", "vision_model", "connector")


def is_vision_parameter(name: str) -> bool:
    """Whether a parameter belongs to the vision tower or its projector (LLaVA, Qwen2-VL, Idefics3 names)."""
    return any(f"{m}." in name for m in VISION_MODULES)
