"""Our LLaVA (vision.py + vlm.py + the Llama decoder over the paged KV cache) == transformers'
LlavaForConditionalGeneration on a tiny random checkpoint, and our image preprocessing ==
transformers' CLIPImageProcessor."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from paged_logits import paged_logits

from pdserve.common.images import ImageInput, ImageProcessing, ImageSlots, image_slots, open_image
from pdserve.model.loader import build_model, default_gguf_path, load_gguf_tokenizer, load_hf_dir
from pdserve.model.vlm import image_spans, merge_image_embeds

IMAGE_TOKEN = 500


def _hf_llava(strategy: str, layer):
    import transformers as tf

    vc = tf.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    tc = tf.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    cfg = tf.LlavaConfig(
        vision_config=vc,
        text_config=tc,
        image_token_index=IMAGE_TOKEN,
        vision_feature_select_strategy=strategy,
        vision_feature_layer=layer,
    )
    torch.manual_seed(0)
    model = tf.LlavaForConditionalGeneration(cfg)
    with torch.no_grad():  # larger weights than HF's init, so logits are not all near zero
        for name, p in model.named_parameters():
            if p.dim() > 1 and "vision" not in name:
                p.mul_(20.0)
    return model.eval().float()


class _Paged:
    """Our decoder with the image rows merged into each step's embeddings, for paged_logits."""

    def __init__(self, model, images):
        self.model, self.arch, self.images = model, model.arch, images
        self.start = 0

    def forward(self, ids, positions, meta, kv, logits_indices):
        start, n = int(positions[0]), len(ids)
        embeds = merge_image_embeds(
            self.model.embed_tokens(ids).clone(), image_spans(self.images, start, n, 0)
        )
        return self.model.forward(ids, positions, meta, kv, logits_indices, inputs_embeds=embeds)


@pytest.mark.parametrize("strategy,layer", [("default", -2), ("full", -1), ("default", [-3, -1])])
def test_llava_logits_match_hf(tmp_path, strategy, layer):
    hf = _hf_llava(strategy, layer)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    load_gguf_tokenizer(str(default_gguf_path())).tok.save(str(tmp_path / "tokenizer.json"))
    loaded = load_hf_dir(tmp_path)
    assert loaded.vision is not None and loaded.vision.spec.image_token_id == IMAGE_TOKEN
    spec = loaded.vision.spec
    n_img = spec.tokens_per_image
    assert n_img == (16 if strategy == "default" else 17)
    assert image_slots(str(tmp_path)) == ImageSlots("<image>", IMAGE_TOKEN, n_img)  # the router's view
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(2, 3, 32, 32, generator=g)
    text = torch.randint(0, 400, (30,), generator=g).tolist()
    ids = text[:5] + [IMAGE_TOKEN] * n_img + text[5:15] + [IMAGE_TOKEN] * n_img + text[15:]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
    ours = build_model(loaded, "float32")
    embeds = loaded.vision.encoder()(pixels)
    assert embeds.shape == (2, n_img, 64)
    images = [ImageInput(5, n_img, b"a", b"", embeds[0]), ImageInput(15 + n_img, n_img, b"b", b"", embeds[1])]
    got = paged_logits(_Paged(ours, images), ids, chunk=7, decode=4, block=4)
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
    # The image changes the answer: the same prompt with other pixels gives other logits.
    with torch.no_grad():
        other = hf(input_ids=torch.tensor([ids]), pixel_values=pixels.flip(0)).logits[0]
    assert (other - ref).abs().max() > 0.1


def test_preprocessing_matches_hf():
    import transformers as tf
    from PIL import Image

    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (50, 80, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    proc = tf.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    ref = proc(images=open_image(buf.getvalue(), 10_000), return_tensors="np")["pixel_values"][0]
    ours = ImageProcessing.from_hf(proc.to_dict(), 32).pixels(open_image(buf.getvalue(), 10_000))
    assert ours.shape == ref.shape == (3, 32, 32)
    np.testing.assert_allclose(ours, ref, atol=1e-5)


def test_vision_alone_loads_only_the_tower(tmp_path):
    """An encoder worker's load: the same tower and projector as the full load, no decoder weights."""
    from pdserve.model.vlm import load_vision

    hf = _hf_llava("default", -2)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    load_gguf_tokenizer(str(default_gguf_path())).tok.save(str(tmp_path / "tokenizer.json"))
    full, alone = load_hf_dir(tmp_path).vision, load_vision(str(tmp_path))
    assert alone is not None and alone.spec == full.spec and alone.weights.keys() == full.weights.keys()
    pixels = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(alone.encoder()(pixels), full.encoder()(pixels))
    assert load_vision("tiny-qwen2") is None
