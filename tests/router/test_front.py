"""The router fronting other engines' workers (router/front.py): blocks named by the router's own hash
of their token ids whatever the worker's hash function, load read from vLLM's and SGLang's metric
names, and (slow) real pdserve workers speaking as plain OpenAI servers with vLLM-format events,
fronted through `--worker vllm=...`: multi-turn conversations land on the worker holding their prefix."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
import zmq

from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.cache.kv_events_vllm import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    VLLMEventSubscriber,
    encode_batch,
)
from pdserve.cache.prefix_cache import prompt_hashes
from pdserve.config import load_config
from pdserve.config_rules import ConfigError
from pdserve.protocol import KVEvent, KVSnapshot
from pdserve.router.front import scrape

MODEL = "tiny-qwen2"
TOKEN = "internal-front-9a1"
WORKER_KEY = "sk-front-upstream-3f"


def _foreign(tokens: list[int], parent: int | None) -> int:
    """A hash function the router does not know (as vLLM's is to it): 64-bit ints."""
    d = hashlib.sha256(repr((parent, tokens)).encode()).digest()
    return int.from_bytes(d[:8], "big")


def _stored(tokens: list[int], bs: int, parent: int | None, medium: str = "GPU") -> tuple[BlockStored, int]:
    hashes = []
    p = parent
    for i in range(0, len(tokens), bs):
        p = _foreign(tokens[i : i + bs], p)
        hashes.append(p)
    return BlockStored(hashes, parent, tokens, bs, medium=medium), hashes[-1]


def _apply(sub: VLLMEventSubscriber, seq: int, *events) -> list:
    out: list = []
    sub._apply(seq, encode_batch(EventBatch(time.time(), list(events))), out)
    return out


def test_blocks_are_renamed_by_the_routers_hash_of_their_tokens():
    sub = VLLMEventSubscriber("inproc://front-rehash", None, "w", rehash=True)
    try:
        bs = 4
        prompt = list(range(1, 19))  # four full blocks and two tokens
        first, tail = _stored(prompt[:8], bs, None)
        second, _ = _stored(prompt[8:16], bs, tail)
        out = _apply(sub, 0, AllBlocksCleared(), first, second)
        assert isinstance(out[0], KVSnapshot)
        stored = [ev for ev in out if isinstance(ev, KVEvent)]
        want = [h.hex() for h in prompt_hashes(prompt, bs)]
        assert [h for ev in stored for h in ev.block_hashes] == want
        assert stored[0].parent_hash is None and stored[1].parent_hash == want[1]
        assert sub.block_size == bs and sub.unchained == 0
        # A block whose parent was never seen (a batch lost before the subscription) cannot be chained.
        orphan, _ = _stored([9, 9, 9, 9], bs, 12345)
        assert _apply(sub, 1, orphan) == [] and sub.unchained == 1
        # Removal names the router's hashes; a block still held in another medium stays mapped.
        cpu_copy = BlockStored(first.block_hashes[:1], None, prompt[:4], bs, medium="CPU")
        _apply(sub, 2, cpu_copy)
        gone = _apply(sub, 3, BlockRemoved(first.block_hashes[:1], "GPU"))
        assert gone[0].type == "removed" and gone[0].block_hashes == [want[0]]
        gone = _apply(sub, 4, BlockRemoved(first.block_hashes[:1], "CPU"))
        assert gone[0].block_hashes == [want[0]] and gone[0].tier == "host"
        assert _apply(sub, 5, BlockRemoved(first.block_hashes[:1], "CPU")) == []  # no longer known
        # A clear forgets every mapping.
        _apply(sub, 6, AllBlocksCleared())
        assert _apply(sub, 7, _stored(prompt[16:], bs, tail)[0]) == []  # 2 tokens for one block: refused
    finally:
        sub.close()


def test_replay_answers_with_a_topic_frame_are_read():
    """Recent vLLM releases answer a replay request with [b"", topic, seq, payload] frames."""
    ctx = zmq.Context.instance()
    replay = ctx.socket(zmq.ROUTER)
    replay.setsockopt(zmq.LINGER, 0)
    port = replay.bind_to_random_port("tcp://127.0.0.1")
    payload = encode_batch(EventBatch(1.0, [AllBlocksCleared()]))

    def answer() -> None:
        if replay.poll(20_000):
            client, _, start = replay.recv_multipart()
            seq = int.from_bytes(start, "big")
            replay.send_multipart([client, b"", b"kv@h@m", seq.to_bytes(8, "big"), payload])
            replay.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    t = threading.Thread(target=answer)
    t.start()
    sub = VLLMEventSubscriber("inproc://front-replay", f"tcp://127.0.0.1:{port}", "w", replay_timeout=20)
    try:
        assert sub.replay(5) == [(5, payload)]
    finally:
        t.join()
        sub.close()
        replay.close()


def test_load_gauges_from_vllm_and_sglang_metric_names():
    vllm = (
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 3.0\n'
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 2.0\n'
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
        "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.7e9\n"
    )
    assert scrape(vllm, "vllm") == {"running": 3.0, "waiting": 2.0, "kv_usage": 0.25, "start": 1.7e9}
    older = '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
    assert scrape(older, "vllm") == {"kv_usage": 0.5}
    sglang = (
        '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="m",tp_rank="0"} 4\n'
        'sglang:num_running_reqs{model_name="m",tp_rank="1"} 1\n'
        '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name="m"} 0\n'
        '# TYPE sglang:token_usage gauge\nsglang:token_usage{model_name="m"} 0.5\n'
    )
    assert scrape(sglang, "sglang") == {"running": 5.0, "waiting": 0.0, "kv_usage": 0.5}


def test_engine_workers_in_the_config():
    ok = {"url": "http://h:8000", "role": "vllm", "kv_events_endpoint": "tcp://h:5557"}
    assert load_config(None, {"router.workers": [ok]}).router.workers == [ok]
    for bad in (
        [{**ok, "kv_events_endpoint": "h:5557"}],
        [{**ok, "snapshot": "tcp://h:1"}],
        [ok, {"url": "http://h:8001", "role": "decode"}],
        [{"url": "http://h:8001", "role": "decode", "kv_events_endpoint": "tcp://h:1"}],
    ):
        with pytest.raises(ConfigError) as e:
            load_config(None, {"router.workers": bad})
        assert e.value.problems[0][0] == "router.workers"


# ---------------------------------------------------------------------- end to end, real processes


def _start(tmp: Path, name: str, args: list[str], cfg: dict) -> ServerProcess:
    port = free_port()
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": MODEL}, **cfg}))
    return ServerProcess(
        pdserve_cmd() + args + ["--config", str(path), "--port", str(port)], port, tmp / name
    )


def _hit_rate(workers: list[ServerProcess], before: list[dict]) -> float:
    now = [httpx.get(w.url + "/health", timeout=10).json() for w in workers]
    hit = sum(n["prefix_cache_hit_tokens"] - b["prefix_cache_hit_tokens"] for n, b in zip(now, before))
    asked = sum(
        n["prefix_cache_queried_tokens"] - b["prefix_cache_queried_tokens"] for n, b in zip(now, before)
    )
    return hit / asked


def _conversations(router: ServerProcess, tag: str, n: int, turns: int) -> dict[int, list[str]]:
    """n conversations, their turns interleaved; the worker that served each turn."""
    history = {
        c: [
            {
                "role": "system",
                "content": f"{tag} conversation {c}: " + " ".join(f"w{c}x{i}" for i in range(40)),
            }
        ]
        for c in range(n)
    }
    served: dict[int, list[str]] = {c: [] for c in range(n)}
    for t in range(turns):
        for c in range(n):
            history[c].append({"role": "user", "content": f"turn {t} of {tag} {c}: " + "more words " * 10})
            r = httpx.post(
                router.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": history[c], "max_tokens": 6, "temperature": 0},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            served[c].append(r.headers["x-pdserve-worker"])
            history[c].append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
    return served


@pytest.mark.slow
def test_conversations_follow_their_prefix_across_fronted_workers(tmp_path):
    worker_cfg = {
        "cache": {
            "kv_events_format": "vllm",
            "kv_events_endpoint": "tcp://127.0.0.1:*",
            "kv_events_snapshot_endpoint": "tcp://127.0.0.1:*",
            "block_size": 4,
            "device_blocks": 512,
        },
        "server": {"internal_token": TOKEN, "worker_api_keys": [WORKER_KEY]},
    }
    workers = [_start(tmp_path, f"w{i}", ["worker", "--role", "mixed"], worker_cfg) for i in range(2)]
    routers: list[ServerProcess] = []
    try:
        for w in workers:
            w.wait_ready(timeout=180)
        specs = []
        for w in workers:
            h = httpx.get(w.url + "/health", timeout=10).json()
            specs += [
                "--worker",
                f"vllm={w.url},events={h['kv_events_endpoint']},replay={h['kv_events_replay_endpoint']}",
            ]
        for policy in ("cost", "round_robin"):
            routers.append(
                _start(
                    tmp_path,
                    f"router-{policy}",
                    ["router", *specs],
                    {"router": {"upstream_api_key": WORKER_KEY}, "load_balancer": {"decode": policy}},
                )
            )
        for r in routers:
            r.wait_ready(timeout=180)
        cost_router, rr_router = routers
        # The fronted router forwards streams as the worker writes them.
        with httpx.stream(
            "POST",
            cost_router.url + "/v1/completions",
            json={"model": MODEL, "prompt": "stream me", "max_tokens": 4, "stream": True},
            timeout=120,
        ) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) >= 2
        r = httpx.post(cost_router.url + "/v1/completions", content=b"{not json", timeout=10)
        assert r.status_code == 400

        rates = {}
        for name, router in (("cost", cost_router), ("round_robin", rr_router)):
            before = [httpx.get(w.url + "/health", timeout=10).json() for w in workers]
            served = _conversations(router, name, n=3, turns=4)  # odd: round robin alternates turns
            rates[name] = _hit_rate(workers, before)
            if name == "cost":  # every later turn went where the conversation's prefix was
                assert all(len(set(s[1:])) == 1 and s[1] == s[0] for s in served.values()), served
        print("prefix hit rate by routing policy:", rates)
        assert rates["cost"] > rates["round_robin"] + 0.15, rates
        metrics = httpx.get(cost_router.url + "/metrics", timeout=10).text
        assert "pdserve_front_cached_blocks_total" in metrics
    finally:
        for p in routers + workers:
            p.stop()
