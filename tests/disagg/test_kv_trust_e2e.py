"""The KV plane's refusals as a client sees them: a router in front of a decode worker and a prefill
worker whose block size differs, all three sharing an internal token (so every job is signed).
The request fails at once with the reason, a prompt longer than the decode side's context gets a
400 before any prefill, and no block stays allocated."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import yaml

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd

MODEL = "tiny-qwen2"
TOKEN = "kv-plane-secret"
ADMIN = "kv-trust-admin"  # with the internal token set, /admin/* takes only admin keys
pytestmark = pytest.mark.slow


def _proc(tmp_path, name: str, args: list[str], cfg: dict) -> ServerProcess:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": MODEL}, "server": {"internal_token": TOKEN}, **cfg}))
    port = free_port()
    return ServerProcess(
        pdserve_cmd() + args + ["--config", str(path), "--port", str(port)], port, tmp_path / f"{name}.log"
    )


def _health(url: str) -> dict:
    return httpx.get(url + "/health").json()


def test_an_incompatible_prefill_worker_and_a_too_long_prompt_reach_the_client_as_clear_errors(tmp_path):
    pkv = free_port()
    # The prefill worker's context is shorter than the decode worker's: the router must take the
    # decode side's (a 100-token prompt fits it) and the prefill worker must refuse for the block size.
    with (
        _proc(
            tmp_path,
            "prefill",
            ["worker", "--role", "prefill", "--kv-port", str(pkv)],
            {"model": {"name": MODEL, "max_model_len": 64}, "cache": {"block_size": 8}},
        ) as prefill,
        _proc(
            tmp_path,
            "decode",
            ["worker", "--role", "decode", "--prefill-endpoints", f"tcp://127.0.0.1:{pkv}"],
            {
                "model": {"name": MODEL, "max_model_len": 128},
                "cache": {"block_size": 4},
                "disagg": {"local_prefill_max_tokens": 8},
            },
        ) as decode,
    ):
        prefill.wait_ready(timeout=120)
        decode.wait_ready(timeout=120)
        with _proc(
            tmp_path,
            "router",
            ["router", "--worker", f"prefill={prefill.url}", "--worker", f"decode={decode.url}"],
            {"router": {"admin_keys": [ADMIN]}},
        ) as router:
            router.wait_ready(timeout=120)
            deadline = time.monotonic() + 60  # both workers seen healthy by the router
            while not all(
                w["healthy"]
                for w in httpx.get(
                    router.url + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN}"}
                ).json()["workers"]
            ):
                assert time.monotonic() < deadline
                time.sleep(0.2)
            client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            prompt = [(7 * j) % 250 + 1 for j in range(100)]
            with pytest.raises(openai.APIStatusError) as e:
                client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
            assert e.value.status_code != 400, e.value.message  # the prompt fits the decode side
            assert (
                "incompatible" in e.value.message
                and "block_size 4 (decode) != 8 (prefill)" in e.value.message
            )
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model=MODEL, prompt=prompt + prompt, max_tokens=4)
            assert "128" in e.value.message
        h, p = _health(decode.url), _health(prefill.url)
        assert (
            h["kv_blocks_free"] == h["kv_blocks_total"]
            and h["loading"] == 0
            and h["kv_blocks_quarantined"] == 0
        )
        assert h["kv_local_prefill_fallbacks_total"] == 0 and h["prefill_tokens_computed"] == 0
        assert p["kv_prefill_jobs_total"] == 0 and p["kv_prefill_jobs_refused_total"] >= 1
        assert p["kv_messages_rejected_total"] == 0  # every job was signed with the shared token
