"""Images beside text streams in PD mode: do image requests slow the streams already decoding?
Prints one JSON line.

Model: a synthetic LLaVA directory built here (no VLM weights ship with pdserve): SmolLM2-135M's
real decoder behind a random CLIP ViT-B/16 tower at 224x224 (12 layers, 196 image tokens) and
projector, the proportions of a small real VLM. Deployment: `pdserve serve` in PD mode (router,
1 prefill + 1 decode worker, one torch thread each), the prefill worker's images encoded by one
encoder worker process (vision.encoder_processes: 1).

Workload: 8 streaming text chats; with images, `--image-streams` clients meanwhile send chats
carrying a new image each (so no cache hit), one after another, until the text streams end
(closed loop: the encoder and prefill workers stay busy however fast the machine is). The figure
is the streams' p99 inter-token latency with images arriving divided by the same without.
Goal <= 1.3: the tower runs in the encoder worker and the image's prompt on the prefill worker;
the decode worker only receives KV.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.bench.metrics import nearest_rank_p99 as p99  # noqa: E402
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd, thread_env  # noqa: E402

MODEL = "synthetic-llava"


def build_vlm(out: Path) -> Path:
    """SmolLM2-135M + a random CLIP ViT-B/16 (224 px) as a LLaVA directory, in the hub layout."""
    import torch
    from safetensors.torch import save_file

    from pdserve.model.loader import default_gguf_path, load_gguf
    from pdserve.model.vision import VisionSpec, tiny_vision_weights

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    lm = load_gguf(default_gguf_path())
    a = lm.arch
    spec = VisionSpec(
        kind="clip",
        hidden_size=768,
        intermediate_size=3072,
        num_layers=12,
        num_heads=12,
        image_size=224,
        patch_size=16,
        text_hidden_size=a.hidden_size,
        image_token_id=16,
    )
    tensors = {"language_model." + k: v.contiguous() for k, v in lm.weights.items()}
    for k, v in tiny_vision_weights(spec, seed=0).items():
        prefix = "vision_tower.vision_model." if k.startswith("vision.") else "multi_modal_projector."
        tensors[prefix + k.split(".", 1)[1]] = v.contiguous()
    save_file({k: v.to(torch.float32) for k, v in tensors.items()}, str(out / "model.safetensors"))
    text = {
        "model_type": "llama",
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope_theta,
        "max_position_embeddings": a.max_position_embeddings,
        "tie_word_embeddings": a.tie_word_embeddings,
        "bos_token_id": a.bos_token_id,
        "eos_token_id": a.eos_token_ids,
    }
    vision = {
        "model_type": "clip_vision_model",
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "image_size": 224,
        "patch_size": 16,
    }
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlavaForConditionalGeneration"],
                "model_type": "llava",
                "text_config": text,
                "vision_config": vision,
                "image_token_index": 16,
                "vision_feature_layer": -2,
                "vision_feature_select_strategy": "default",
                "projector_hidden_act": "gelu",
                "tie_word_embeddings": a.tie_word_embeddings,
            }
        )
    )
    lm.tokenizer.tok.save(str(out / "tokenizer.json"))  # id 16, <empty_output>, is the image token
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": lm.tokenizer.chat_template}))
    (out / "preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224}})
    )
    return out


def image_url(seed: int) -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (240, 320, 3), dtype=np.uint8)).save(
        buf, "JPEG"
    )
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


async def stream(client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int) -> list[float]:
    """Arrival times of a text chat's chunks."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Count to {i + 10}, slowly, please."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())
    return times


async def images_until(
    done: asyncio.Event, client: httpx.AsyncClient, url: str, model: str, seed: int, out: dict
) -> None:
    """Chats with a new image each, one after another (closed loop: the encoder and the prefill
    worker are kept busy however fast this machine is), until `done`."""
    k = 0
    while not done.is_set():
        k += 1
        content = [
            {"type": "text", "text": "Describe this picture."},
            {"type": "image_url", "image_url": {"url": image_url(seed * 1000 + k)}},
        ]
        try:
            r = await client.post(
                url + "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1},
            )
            out["ok" if r.status_code == 200 else "failed"] += 1
        except httpx.HTTPError:
            out["failed"] += 1


async def phase(url: str, model: str, image_streams: int, streams: int, max_tokens: int, seed: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        tasks = [asyncio.create_task(stream(client, url, model, i, max_tokens)) for i in range(streams)]
        done, counts = asyncio.Event(), {"ok": 0, "failed": 0}
        senders = [
            asyncio.create_task(images_until(done, client, url, model, seed * 10 + j, counts))
            for j in range(image_streams)
        ]
        results = await asyncio.gather(*tasks)
        done.set()
        await asyncio.gather(*senders)
    itls = [b - a for ts in results for a, b in zip(ts[1:], ts[2:])]  # the first gap is TTFT
    return {
        "p99_itl_ms": p99(itls) * 1e3,
        "median_itl_ms": statistics.median(itls) * 1e3,
        "images_done": counts["ok"],
        "images_failed": counts["failed"],
    }


async def warm_up(url: str, model: str) -> None:
    """One image (the encoder worker's first job loads nothing more) and one text stream."""
    async with httpx.AsyncClient(timeout=600) as client:
        content = [
            {"type": "text", "text": "Describe this picture."},
            {"type": "image_url", "image_url": {"url": image_url(0)}},
        ]
        r = await client.post(
            url + "/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 1},
        )
        r.raise_for_status()
        await stream(client, url, model, 0, 8)


def main(argv: list[str] | None = None) -> int:
    from pdserve.utils.cpu import describe

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per text stream")
    p.add_argument("--image-streams", type=int, default=1, help="clients sending image chats back to back")
    p.add_argument("--out-dir", default="/tmp/pdserve-images-itl")
    a = p.parse_args(argv)
    out_dir = Path(a.out_dir)
    model_dir = build_vlm(out_dir / MODEL)
    # Generous deadlines: on a shared machine an image may queue a while at the encoder; the figure
    # is about the text streams, and a failed image request stops the run.
    (out_dir / "c.yaml").write_text(
        f"model: {{name: {model_dir}}}\n"
        "vision: {encoder_processes: 1, encode_timeout_s: 300}\n"
        "disagg: {queue_timeout_s: 300}\n"
    )
    port = free_port()
    cmd = pdserve_cmd() + ["serve", "--config", str(out_dir / "c.yaml"), "--mode", "pd", "--port", str(port)]
    with ServerProcess(cmd, port, out_dir / "pd.log", env=thread_env(1)) as srv:
        srv.wait_ready(timeout=600)
        model = str(model_dir)
        asyncio.run(warm_up(srv.url, model))
        quiet = asyncio.run(phase(srv.url, model, 0, a.streams, a.max_tokens, 1))
        busy = asyncio.run(phase(srv.url, model, a.image_streams, a.streams, a.max_tokens, 2))
    ratio = busy["p99_itl_ms"] / quiet["p99_itl_ms"]
    print(
        f"pd: p99 ITL {quiet['p99_itl_ms']:.1f} ms without images, {busy['p99_itl_ms']:.1f} ms with "
        f"{busy['images_done']} images ({busy['images_failed']} failed): {ratio:.2f}x",
        file=sys.stderr,
    )
    print(
        json.dumps(
            {
                "bench": "images_itl",
                "cpu": describe(),
                "streams": a.streams,
                "image_streams": a.image_streams,
                "ratio": round(ratio, 2),
                "goal_ratio": 1.3,
                "quiet_p99_itl_ms": round(quiet["p99_itl_ms"], 1),
                "busy_p99_itl_ms": round(busy["p99_itl_ms"], 1),
                "quiet_median_itl_ms": round(quiet["median_itl_ms"], 1),
                "busy_median_itl_ms": round(busy["median_itl_ms"], 1),
                "images_done": busy["images_done"],
                "images_failed": busy["images_failed"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
