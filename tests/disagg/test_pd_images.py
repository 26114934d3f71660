"""tiny-llava prompts with images through a prefill and a decode engine: the PrefillJob carries the
images, the prefill worker encodes them, and the greedy output equals the mixed engine's; a repeated
image is a prefix-cache hit on the decode worker; pools back to their start."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from pd_harness import pd_config, pd_pair
from vlm_images import image_chat

from pdserve import SamplingParams
from pdserve.engine.engine import LLMEngine
from pdserve.engine.llm import LLM
from pdserve.model.loader import load_model_files

VLM = {"model.name": "tiny-llava"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    llm = LLM(model="tiny-llava", loaded=load_model_files("tiny-llava"), block_size=4, device_blocks=256)
    return [llm._chat_prompt(image_chat(*seeds)) for seeds in ((1,), (2, 3), (1,))]


def _mixed(prompts, overrides=None):
    eng = LLMEngine(pd_config("mixed", overrides={**VLM, **(overrides or {})}))
    for i, (ids, images) in enumerate(prompts):
        eng.add_request(f"r{i}", ids, GREEDY, images=images)
    want: dict[str, list[int]] = {}
    for out in eng.run_until_idle():
        want.setdefault(out.request_id, []).extend(out.new_token_ids)
    return want


def run_pd(prompts, overrides=None):
    """Outputs of the PD pair, and the two engines' stats at the end."""
    o = {**VLM, **(overrides or {})}
    with pd_pair(prefill_config=pd_config("prefill", overrides=o), decode_overrides=o) as (prefill, decode):
        for i, (ids, images) in enumerate(prompts):  # one at a time: the third repeats the first's image
            decode.submit(
                lambda e, i=i, ids=ids, images=images: e.add_request(f"r{i}", ids, GREEDY, images=images)
            )
            decode.wait([f"r{i}"])
        decode.wait_idle()
        prefill.wait_idle()
        assert not decode.errors, decode.errors
        return (
            decode.outputs,
            prefill.engine.stats(),
            decode.engine.stats(),
            prefill.engine.images,
            decode.engine.images,
        )


def test_pd_images_equal_mixed(prompts):
    want = _mixed(prompts)
    got, pstats, dstats, pimages, dimages = run_pd(prompts)
    assert got == want
    # The first two prompts were prefilled remotely (their images encoded there); the third's image
    # blocks hit the decode worker's cache, and what is left is prefilled there with no image to encode.
    assert pimages.images_encoded_total == 3 and dimages.images_encoded_total == 0
    assert dstats["prefix_cache_hit_tokens"] >= prompts[0][1][0].offset + 16 - 4


@pytest.mark.slow  # the prefill worker spawns an encoder process
def test_pd_images_through_encoder_workers_equal_mixed(prompts):
    """The prefill worker's images go to its encoder worker; the embeddings come back over ZeroMQ."""
    want = _mixed(prompts)
    got, _, _, pimages, _ = run_pd(prompts, {"vision.encoder_processes": 1})
    assert got == want
    assert pimages.pool is not None and pimages.pool.jobs_total == 2 and pimages.images_encoded_total == 3
    # Both engines were closed with the pair: their encoders' socket files are gone.
    assert not list(Path(tempfile.gettempdir()).glob(f"pdserve-enc-{os.getpid()}-*"))
