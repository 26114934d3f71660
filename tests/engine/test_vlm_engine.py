"""tiny-llava through the engine: chat with images (data: URLs), chunked prefill, the prefix cache
keyed by image content, bad images refused, and the pool back to its start."""

from __future__ import annotations

import pytest
from vlm_images import data_url, image_bytes, image_chat

from pdserve import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.model.loader import load_model_files

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return load_model_files("tiny-llava")


def _llm(loaded, **kw):
    return LLM(model="tiny-llava", loaded=loaded, block_size=4, device_blocks=256, **kw)


def test_images_change_the_answer_and_chunking_does_not(loaded):
    llm = _llm(loaded, max_num_batched_tokens=512)
    a, b = llm.chat(image_chat(1), GREEDY)[0], llm.chat(image_chat(2), GREEDY)[0]
    assert a.prompt_token_ids.count(16) == 16 and a.finish_reason == "length"
    assert a.token_ids != b.token_ids  # the image is read
    chunked = _llm(loaded, max_num_batched_tokens=7, prefix_cache=False)
    assert chunked.chat(image_chat(1), GREEDY)[0].token_ids == a.token_ids
    assert chunked.engine.pool.num_free == chunked.engine.pool.num_blocks


def test_a_repeated_image_is_a_prefix_cache_hit(loaded):
    llm = _llm(loaded)
    eng = llm.engine
    first = llm.chat(image_chat(3, 4), GREEDY)[0]
    assert eng.images.images_encoded_total == 2
    hit0 = eng.prefix_cache.hit_tokens
    again = llm.chat(image_chat(3, 4), GREEDY)[0]
    assert again.token_ids == first.token_ids
    # Every full block of the prompt hit, images included; nothing encoded again.
    assert eng.prefix_cache.hit_tokens - hit0 >= len(first.prompt_token_ids) - 4
    assert eng.images.images_encoded_total == 2
    # Same text and first image, another second image: the hit stops before the second image.
    hit1 = eng.prefix_cache.hit_tokens
    other = llm.chat(image_chat(3, 5), GREEDY)[0]
    second_image = other.prompt_token_ids.index(16) + 16
    assert 0 < eng.prefix_cache.hit_tokens - hit1 <= second_image
    # The first image again only if its last block (not cached: it holds the second image too) has some of it.
    assert eng.images.images_encoded_total == 3 + bool((second_image - 16) % 4)
    assert eng.pool.num_free == eng.pool.num_blocks  # cached blocks count as free


def test_same_output_with_and_without_the_prefix_cache(loaded):
    cached = _llm(loaded)
    cached.chat(image_chat(6), GREEDY)
    plain = _llm(loaded, prefix_cache=False)
    assert cached.chat(image_chat(6), GREEDY)[0].token_ids == plain.chat(image_chat(6), GREEDY)[0].token_ids


def test_jpeg_and_bad_images(loaded):
    llm = _llm(loaded)
    assert llm.chat(image_chat(7, fmt="JPEG"), GREEDY)[0].finish_reason == "length"
    bad = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
        }
    ]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\].*not a decodable image"):
        llm.chat(bad, GREEDY)
    with pytest.raises(ValueError, match="must not contain the model's image token"):
        llm.chat(
            [{"role": "user", "content": [{"type": "text", "text": "<empty_output>"}]}] + image_chat(1),
            GREEDY,
        )
    thin = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": data_url(image_bytes(1, size=(1, 400)))}}],
        }
    ]
    with pytest.raises(ValueError, match="sides more than 50 times apart"):
        llm.chat(thin, GREEDY)
    with pytest.raises(ValueError, match="more than 1 images"):
        _llm(loaded, vision__max_images=1).chat(image_chat(1, 2), GREEDY)
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_text_only_model_refuses_images():
    llm = LLM(model="tiny-qwen2", device_blocks=64)
    with pytest.raises(ValueError, match="takes no images|image_url"):
        llm.chat(image_chat(1), GREEDY)
