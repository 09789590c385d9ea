"""Images: read with one-line errors, prepared once per picture, expanded once in the prompt."""

import io
from pathlib import Path

import pytest
import torch
from PIL import Image as PILImage

from agent_r1.env.prompt_format import NO_VISION, ChatFormat, TextFormat, prompt_format_for
from agent_r1.models.vision import (
    ImageEncoder,
    embed_with_images,
    image_features,
    image_token_id,
    placeholder_keys,
    read_image,
    text_only,
)
from tests.conftest import picture


def image_message(*sources, text="What is in the picture?"):
    return {
        "role": "user",
        "content": [*({"type": "image", "image": s} for s in sources), {"type": "text", "text": text}],
    }


def test_read_image_takes_arrays_paths_bytes_and_data_urls(tmp_path):
    array = picture(0)
    path = tmp_path / "p.png"
    PILImage.fromarray(array).save(path)
    raw = path.read_bytes()
    import base64

    url = "data:image/png;base64," + base64.b64encode(raw).decode()
    floats = array.astype("float32") / 255
    for source in (array, str(path), path, raw, url, PILImage.fromarray(array).convert("L").convert("RGB")):
        got = read_image(source)
        assert got.mode == "RGB" and got.size == (24, 20)
    assert read_image(floats).tobytes() == read_image(array).tobytes()  # floats in [0, 1] round to the same bytes


@pytest.mark.parametrize(
    "source, message",
    [
        (b"not a png", "cannot read image bytes: UnidentifiedImageError"),
        ("missing.png", "cannot read image 'missing.png': FileNotFoundError"),
        (Path("no/such.png"), "cannot read image 'no/such.png': FileNotFoundError"),
        ("data:image/png;base64,@@@", "cannot read image 'data:image/png;base64,@@@'"),
        (12, "unsupported image type int"),
    ],
)
def test_unreadable_images_are_one_line_errors(source, message):
    with pytest.raises(ValueError, match=message) as err:
        read_image(source)
    assert "\n" not in str(err.value)


def test_truncated_png_is_an_error_not_a_partial_picture(tmp_path):
    buf = io.BytesIO()
    PILImage.fromarray(picture(1, (64, 64))).save(buf, format="PNG")
    with pytest.raises(ValueError, match="cannot read image bytes"):
        read_image(buf.getvalue()[: len(buf.getvalue()) // 2])


def test_encoder_expands_one_image_token_into_its_placeholders(tiny_llava):
    _, processor = tiny_llava
    enc = ImageEncoder(processor)
    a, a2, b = enc.encode(picture(0)), enc.encode(picture(0)), enc.encode(picture(1))
    assert a is a2  # prepared once per picture
    assert a.num_tokens == 4 and a.expansion == [enc.image_token_id] * 4  # (16 / 8)^2 patches
    assert a.digest != b.digest and a.inputs["pixel_values"].shape == (1, 3, 16, 16)
    assert not torch.equal(a.inputs["pixel_values"], b.inputs["pixel_values"])


def test_chat_format_expands_each_image_once_and_lists_them_in_order(tiny_llava):
    model, processor = tiny_llava
    fmt = prompt_format_for(processor)
    assert isinstance(fmt, ChatFormat) and fmt.encoder is not None
    token = image_token_id(model)
    first = [{"role": "system", "content": "sys"}, image_message(picture(0), picture(1))]
    ids, images = fmt.initial(first), fmt.images(first)
    assert ids.count(token) == 8 and [i.digest for i in images] == [
        fmt.encoder.encode(picture(s)).digest for s in (0, 1)
    ]
    tool = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "<tool_response>\nzoom"}, {"type": "image", "image": picture(2)}],
        }
    ]
    more = fmt.continuation(tool, after_eos=False)
    assert more.count(token) == 4 and len(fmt.images(tool)) == 1
    # the continuation is exactly what rendering the whole conversation adds, placeholders included
    sampled = fmt.tokenizer.encode("I zoom.", add_special_tokens=False)
    whole = fmt.initial([*first, {"role": "assistant", "content": "I zoom."}, *tool])
    assert whole == ids + sampled + more


def test_image_token_written_as_text_makes_no_placeholder(tiny_llava):
    _, processor = tiny_llava
    fmt = prompt_format_for(processor)
    ids = fmt.initial([{"role": "user", "content": "print('<image>')"}])
    assert fmt.encoder.image_token_id not in ids and fmt.images([{"role": "user", "content": "x"}]) == []


def test_text_only_models_see_a_note_where_an_image_was(tokenizer):
    message = image_message(picture(0), text="Describe it.")
    assert text_only(message, NO_VISION)["content"] == NO_VISION + "Describe it."
    for fmt in (ChatFormat(tokenizer), TextFormat(tokenizer)):
        text = tokenizer.decode(fmt.initial([message]))
        assert NO_VISION in text and fmt.images([message]) == []


def test_placeholder_keys_tell_images_apart(tiny_llava):
    model, processor = tiny_llava
    enc, token = ImageEncoder(processor), image_token_id(model)
    a, b = enc.encode(picture(0)), enc.encode(picture(1))
    ids = [5, token, token, token, token, 6]
    ka, kb = placeholder_keys(ids, [a], token), placeholder_keys(ids, [b], token)
    assert ka[0] == 5 and ka[-1] == 6 and len(set(ka[1:5])) == 1 and ka[1] < 0
    assert ka != kb and placeholder_keys(ids, [a], token) == ka
    with pytest.raises(ValueError, match="more image placeholders than images"):
        placeholder_keys(ids + ids, [a], token)


def test_embedding_a_cut_takes_the_matching_feature_rows(tiny_llava):
    """A prefill that continues a cached context (or a shared prefix cut inside an image) embeds the
    rest of the prompt with the rows of each image's features that fall in it."""
    model, processor = tiny_llava
    enc, token = ImageEncoder(processor), image_token_id(model)
    a, b = enc.encode(picture(0)), enc.encode(picture(1))
    ids = torch.tensor([7, token, token, token, token, 8, token, token, token, token, 9])
    with torch.no_grad():
        whole = embed_with_images(model, ids, [a, b], token)
        fa, fb = image_features(model, [a, b])
        assert torch.equal(whole[1:5], fa) and torch.equal(whole[6:10], fb)
        cut = embed_with_images(model, ids[3:], [a, b], token, skip=2)  # from inside image a
        assert torch.equal(cut, whole[3:])
