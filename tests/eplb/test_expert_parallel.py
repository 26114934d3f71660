"""Expert parallelism across processes (gloo, one torch thread per rank) on tiny MoE models.

EP=2 and EP=4 give EP=1's greedy tokens and logits; a runtime rebalance under load (the trigger's and
forced ones, with redundant expert slots) leaves outputs identical; workers exit when rank 0 dies, and
rank 0's engine raises (not hangs) when a worker is killed or stuck; a served EP model exposes /eplb and the balancer's metrics and stops its ranks on SIGTERM.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from ep_runs import PARAMS, PROMPTS, assert_same
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve import LLM, SamplingParams
from pdserve.bench.procs import ServerProcess, free_port, pdserve_cmd
from pdserve.model.attention import build_metadata
from pdserve.model.loader import load_model_files

pytestmark = pytest.mark.slow
# A small token budget: long prompts prefill in chunks, in the same steps as other requests' decodes.
ENGINE = dict(threads=1, device_blocks=96, max_num_batched_tokens=24)


def _llm(name, loaded, **kw):
    return LLM(model=name, loaded=loaded, **ENGINE, **kw)


def _chunked_logits(model, ids: list[int]) -> torch.Tensor:
    """Prefill in two chunks then decode two tokens on a private KV cache."""
    a, block = model.arch, 16
    kv = torch.zeros(a.kv_cache_shape(4 * block))
    out, done = [], 0
    for n in (len(ids) - 8, 6, 1, 1):
        meta = build_metadata([(list(range(4)), done, n)], block, a.sliding_window, "cpu")
        out.append(
            model.forward(
                torch.tensor(ids[done : done + n]), torch.arange(done, done + n), meta, kv, torch.arange(n)
            )
        )
        done += n
    return torch.cat(out)


@pytest.mark.parametrize(
    "name,ep,redundant,attention",
    [
        ("tiny-qwen2-moe", 2, 0, "data"),
        ("tiny-qwen2-moe", 2, 0, "replicated"),
        ("tiny-deepseek-moe", 4, 4, "data"),
        ("tiny-deepseek-moe", 4, 4, "replicated"),
        ("tiny-mixtral", 4, 0, "data"),
        ("tiny-qwen3-moe", 2, 2, "data"),
        ("tiny-deepseek-v3", 2, 0, "data"),
        ("tiny-deepseek-v2-lite", 4, 0, "data"),
        ("tiny-kimi", 2, 0, "data"),
        ("tiny-mixtral", 4, 0, "overlap"),
        ("tiny-deepseek-v3", 2, 0, "overlap"),
    ],
)
def test_ep_matches_ep1(name, ep, redundant, attention):
    """Every MoE family, both attention modes (data also with two micro-batches overlapping their
    exchanges, model.ep_overlap): EP=N gives EP=1's greedy tokens and logprobs."""
    loaded = load_model_files(name)
    ref = _llm(name, loaded)
    want = ref.generate(PROMPTS, PARAMS)
    llm = _llm(
        name,
        loaded,
        model__expert_parallel=ep,
        model__num_redundant_experts=redundant,
        model__ep_attention="data" if attention == "overlap" else attention,
        model__ep_overlap=attention == "overlap",
    )
    try:
        assert (llm.engine.model.exchange.baton is not None) == (attention == "overlap")
        got = llm.generate(PROMPTS, PARAMS)
        assert_same(got, want)
        # Data-parallel steps sent rows between the ranks; replicated ones none.
        assert (llm.engine.model.exchange.dispatch_rows > 0) == (attention != "replicated")
        # Each rank counts only the tokens it owns: the balancer's load is their sum, the whole batch
        # (the choices themselves may differ where a near tie in the gate falls the other way).
        heat, ref_heat = llm.engine.model.eplb.to_dict(), ref.engine.model.eplb.to_dict()
        assert heat["steps_in_window"] == ref_heat["steps_in_window"]
        assert heat["total"] == ref_heat["total"] and heat["total"][0] > 0
        ids = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(3)).tolist()
        torch.testing.assert_close(
            _chunked_logits(llm.engine.model, ids),
            _chunked_logits(ref.engine.model, ids),
            atol=1e-4,
            rtol=1e-4,
        )
    finally:
        llm.engine.close()


@pytest.mark.parametrize(
    "quant,redundant,attention,gemm",
    [("int8", 0, "replicated", "auto"), ("int4", 2, "replicated", "auto"), ("int4", 2, "data", "torch")],
)
def test_quantized_ep_matches_ep1(quant, redundant, attention, gemm):
    """Quantized experts, packed once by rank 0 and shared: EP=2 (with replicas in redundant slots)
    gives EP=1's greedy tokens. Data-parallel attention gives each rank fewer rows than EP=1's step,
    and replicas split a slot's rows, while the native kernels' paths change with the rows (a row's
    result depends on which side of a path's start its product falls): with replicas, the native
    products run model.batch_invariant's paths; data-parallel attention is checked on torch's."""
    name = "tiny-mixtral"
    loaded = load_model_files(name)
    common = dict(model__quantization=quant, model__gemm_kernel=gemm, model__batch_invariant=redundant > 0)
    want = _llm(name, loaded, **common).generate(PROMPTS, PARAMS)
    llm = _llm(
        name,
        loaded,
        **common,
        model__expert_parallel=2,
        model__num_redundant_experts=redundant,
        model__ep_attention=attention,
    )
    try:
        assert llm.engine.model.model.blocks[0].placement.gate_up.kind == quant
        got = llm.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert (llm.engine.model.exchange.dispatch_rows > 0) == (attention == "data")
    finally:
        llm.engine.close()


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_every_rank_takes_rank_0s_kernel_paths(quant):
    """The kernel's row-count paths (qgemm.paths: where the tuning starts AMX's tiles, the lookup and
    the rounded tile) are rank 0's in every rank, whatever the rank's own process would have chosen: set
    here on rank 0 to starts other than a fresh process's defaults, EP=2 still gives EP=1's tokens (a
    rank left on its own paths computes other bits for the rows it takes)."""
    from pdserve.model.kernels import qgemm, tuning

    tuning.tune()
    saved = qgemm.paths()
    if not saved:
        pytest.skip("the native kernels do not load here")
    name = "tiny-mixtral"
    loaded = load_model_files(name)
    common = dict(model__quantization=quant)
    qgemm.set_paths({**saved, "lut_from": 1, "amx_exact_from": 2, "amx8_from": 2, "pairs_rounded_from": 9})
    forced = qgemm.paths()
    llm = None
    try:
        want = _llm(name, loaded, **common).generate(PROMPTS, PARAMS)
        llm = _llm(
            name,
            loaded,
            **common,
            model__expert_parallel=2,
            model__ep_attention="replicated",
        )
        got = llm.generate(PROMPTS, PARAMS)
        assert qgemm.paths() == forced
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    finally:
        if llm is not None:
            llm.engine.close()
        qgemm.set_paths(saved)


def test_bfloat16_dispatch_halves_the_rows_bytes_and_stays_near_ep1():
    """model.ep_dispatch_dtype bfloat16 on a float32 model: the rows sent to the other rank cost 2
    bytes a value, and until a near tie first falls the other way (the random models have many) each
    step's top logprob stays within 0.1 of EP=1's: the rounding of a row (2**-9 relative) moves the
    logits far less than that."""
    name = "tiny-mixtral"
    loaded = load_model_files(name)
    want = _llm(name, loaded).generate(PROMPTS, PARAMS)
    llm = _llm(name, loaded, model__expert_parallel=2, model__ep_dispatch_dtype="bfloat16")
    try:
        got = llm.generate(PROMPTS, PARAMS)
        ex = llm.engine.model.exchange
        assert ex.dispatch_rows > 0 and ex.dispatch_bytes == ex.dispatch_rows * loaded.arch.hidden_size * 2
        for g, w in zip(got, want):
            for a, b, ta, tb in zip(g.logprobs, w.logprobs, g.token_ids, w.token_ids):
                assert abs(a.top[0][1] - b.top[0][1]) <= 0.1
                if ta != tb:
                    break
    finally:
        llm.engine.close()


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_runtime_rebalance_under_load_keeps_outputs(quant):
    """EP=2 with 4 redundant slots; the trigger checks every 2 steps with a threshold any skew
    exceeds, and two placements are forced mid-generation on top. int4: packed slots move whole, on
    model.batch_invariant's products (replicas split a slot's rows, and int4's row-count paths give a
    row other bits in fewer rows)."""
    name = "tiny-mixtral"
    loaded = load_model_files(name)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    common = dict(model__quantization=quant, model__batch_invariant=quant != "none")
    want = [o.token_ids for o in _llm(name, loaded, **common).generate(PROMPTS, params)]
    llm = _llm(
        name,
        loaded,
        **common,
        model__expert_parallel=2,
        model__num_redundant_experts=4,
        model__eplb_interval=2,
        model__eplb_threshold=1.0,
        model__eplb_window=8,
    )
    model, engine = llm.engine.model, llm.engine
    registry = CollectorRegistry()
    model.eplb.register_metrics(registry)
    g = torch.Generator().manual_seed(5)
    try:
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), llm.tokenizer.encode(p), params)
        outputs: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
        step, forced = 0, []
        while engine.has_unfinished():
            if step in (5, 25):  # mid-generation: a random placement, every expert at least once
                new = torch.stack(
                    [
                        torch.cat([torch.randperm(16, generator=g), torch.randint(0, 16, (4,), generator=g)])
                        for _ in range(2)
                    ]
                )
                model.request_placement(new)
                forced.append(new)
            for out in engine.step():
                outputs[out.request_id] += out.new_token_ids
            step += 1
        assert [outputs[str(i)] for i in range(len(PROMPTS))] == want
        assert model.eplb.rebalances >= 3, model.eplb.rebalances  # two forced, at least one triggered
        assert not any(torch.equal(model.model.phy2log, f) for f in forced)  # the trigger moved on from them
        text = generate_latest(registry).decode()
        assert "pdserve_eplb_rebalances_total" in text and "pdserve_eplb_expert_activations{" in text
        assert registry.get_sample_value("pdserve_eplb_rebalances_total") == model.eplb.rebalances
        assert registry.get_sample_value("pdserve_eplb_experts_moved_total") > 0
    finally:
        llm.engine.close()


def metrics_for(name: str, text: str) -> str:
    """The lines of one metric family in an exposition."""
    return "\n".join(line for line in text.splitlines() if name in line) + "\n"


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in "ZX":
            kids.append(int(stat.parent.name))
    return kids


def _mixed_ep2_cmd(port: int) -> list[str]:
    """`pdserve serve` of tiny-mixtral in mixed mode with EP=2, one thread per rank."""
    return pdserve_cmd() + [
        "serve",
        "--mode",
        "mixed",
        "--model",
        "tiny-mixtral",
        "--expert-parallel",
        "2",
        "--threads",
        "1",
        "--port",
        str(port),
        "--device-blocks",
        "64",
    ]


def _ep_ranks(pid: int) -> list[int]:
    """The expert-parallel ranks `pid` spawned (its children started by multiprocessing's spawn)."""
    return [w for w in _children(pid) if b"spawn_main" in Path(f"/proc/{w}/cmdline").read_bytes()]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def test_workers_exit_when_rank0_is_killed():
    code = (
        "import os, sys, time, torch; torch.set_num_threads(1)\n"
        "from pdserve.config import ModelConfig\n"
        "from pdserve.model.loader import build_model, load_model_files\n"
        "m = build_model(load_model_files('tiny-mixtral'), model_config=ModelConfig(expert_parallel=2))\n"
        "print('ready', flush=True); time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        workers = _ep_ranks(proc.pid)
        assert len(workers) == 1
        proc.kill()
        proc.wait(10)
        assert _wait_gone(workers, 15) == []
    finally:
        proc.kill()


def _outcome_within(fn, seconds: float):
    """fn()'s result or exception; fails the test if fn is still running after `seconds` (a hang)."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # the outcome under test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still waiting after {seconds} s: a lost rank hangs the engine"
    return box.get("error", box.get("result"))


@pytest.mark.parametrize("how,overlap", [("killed", False), ("stuck", False), ("stuck", True)])
def test_engine_fails_when_a_rank_is_lost(how, overlap):
    """A rank killed outright (its connection closes) or stuck (SIGSTOP, as behind a cut link: only the
    deadline can tell) makes the engine's next step raise instead of waiting forever, and every step
    after it raise at once; close() still returns. With two micro-batches the other one stops too."""
    # A short deadline (model.ep_timeout_s) keeps the stuck case quick.
    llm = _llm(
        "tiny-mixtral",
        load_model_files("tiny-mixtral"),
        model__expert_parallel=2,
        model__ep_timeout_s=5,
        model__ep_overlap=overlap,
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    worker = llm.engine.model._ranks.procs[0]
    try:
        assert len(llm.generate(PROMPTS[:1], params)[0].token_ids) == 4
        if how == "killed":
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(30)
        else:
            os.kill(worker.pid, signal.SIGSTOP)
        err = _outcome_within(lambda: llm.generate(PROMPTS[:2], params), 120)
        assert isinstance(err, RuntimeError), err
        again = _outcome_within(lambda: llm.generate(PROMPTS[:1], params), 60)
        assert isinstance(again, RuntimeError) and "rank failed" in str(again), again
    finally:
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGKILL)
        _outcome_within(llm.engine.close, 120)


def test_served_ep_worker_fails_its_health_when_a_rank_dies_while_idle(tmp_path):
    """No request needs to fail first: the idle engine sees the lost rank and /health answers 503
    engine_dead, which the router reads to route around the worker."""
    port = free_port()
    cmd = _mixed_ep2_cmd(port)
    with ServerProcess(cmd, port, tmp_path / "server.log") as srv:
        srv.wait_ready(timeout=120)
        worker_url = srv.url  # mixed mode: the worker serves the API itself
        assert httpx.get(worker_url + "/health").json()["role"] == "mixed"
        (rank1,) = _ep_ranks(srv.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (r := httpx.get(worker_url + "/health")).status_code == 200:
            assert time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.2)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        assert "exited" in r.json()["error"]["message"], r.text


def test_served_ep_model_exposes_eplb_and_stops_cleanly(tmp_path):
    port = free_port()
    cmd = _mixed_ep2_cmd(port)
    with ServerProcess(cmd, port, tmp_path / "server.log") as srv:
        srv.wait_ready(timeout=120)
        workers = _ep_ranks(srv.proc.pid)
        assert len(workers) == 1, srv.log_tail()
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"model": "tiny-mixtral", "prompt": "Hello there", "max_tokens": 8, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        heat = httpx.get(srv.url + "/eplb").json()
        assert heat["num_experts"] == 16 and heat["layer_ids"] == [0, 1] and heat["num_ranks"] == 2
        assert sum(heat["total"]) > 0 and len(heat["phy2log"][0]) == 16
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'pdserve_eplb_expert_activations{expert="0",layer="0"}' in metrics
        assert "pdserve_eplb_imbalance" in metrics
        # The EP plane's traffic: the prompt's rank sent tokens to the other rank's experts.
        traffic = heat["traffic"]
        assert traffic["steps"] >= 8 and traffic["dispatch"] + traffic["combine"] > 0
        family = next(text_string_to_metric_families(metrics_for("pdserve_ep_bytes", metrics)))
        by_kind = {s.labels["kind"]: s.value for s in family.samples if s.name.endswith("_total")}
        assert set(by_kind) == {"dispatch", "combine", "kv_shipped", "kv_mirrored", "logits", "experts"}
        assert by_kind["dispatch"] + by_kind["combine"] >= traffic["dispatch"] + traffic["combine"]
        os.kill(srv.proc.pid, signal.SIGTERM)  # the server only: it must stop its ranks itself
        assert srv.proc.wait(30) == 0, srv.log_tail()
        assert _wait_gone(workers, 15) == [], srv.log_tail()


@pytest.mark.parametrize("prefill_ep,decode_ep,overlap", [(2, 2, False), (2, 4, False), (2, 2, True)])
def test_pd_decode_worker_with_ep_reads_transferred_kv(tmp_path, prefill_ep, decode_ep, overlap):
    """In the PD deployment the prefill worker writes the prompt's KV into the decode worker's pool;
    the decode worker's other ranks map that pool (each attends the sequences the step gives it), so
    EP=2 or 4 decodes EP=1's tokens, also from a prefill worker of another EP size. With two
    micro-batches a step a layer's KV is shipped once both have written it."""
    port = free_port()
    prompt = "The capital of France is a city with a long history and many famous buildings, such as"
    cfg = tmp_path / "ep.yaml"
    cfg.write_text(
        f"model:\n  ep_overlap: {str(overlap).lower()}\n"
        f"deployment:\n  prefill:\n    expert_parallel: {prefill_ep}\n"
        f"  decode:\n    expert_parallel: {decode_ep}\n"
    )
    cmd = pdserve_cmd() + [
        "serve",
        "--config",
        str(cfg),
        "--model",
        "tiny-mixtral",
        "--threads",
        "1",
        "--port",
        str(port),
        "--device-blocks",
        "64",
        "--local-prefill-max-tokens",
        "1",
    ]
    with ServerProcess(cmd, port, tmp_path / "pd.log") as srv:
        srv.wait_ready(timeout=120)
        deadline = time.monotonic() + 60
        while not all(w["healthy"] for w in httpx.get(srv.url + "/health").json()["workers"]):
            assert time.monotonic() < deadline, srv.log_tail()
            time.sleep(0.5)
        r = httpx.post(
            srv.url + "/v1/completions",
            json={"model": "tiny-mixtral", "prompt": prompt, "max_tokens": 12, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        want = LLM(model="tiny-mixtral", threads=1).generate(
            [prompt], SamplingParams(temperature=0, max_tokens=12)
        )
        assert r.json()["choices"][0]["text"] == want[0].text
        decode = next(w for w in httpx.get(srv.url + "/health").json()["workers"] if w["role"] == "decode")
        stats = httpx.get(decode["url"] + "/health").json()
        assert stats["prefill_tokens_computed"] == 0 and stats["kv_transfers_completed_total"] >= 1, stats
        ranks = {w["role"]: w["url"] for w in httpx.get(srv.url + "/health").json()["workers"]}
        for role, ep in (("prefill", prefill_ep), ("decode", decode_ep)):
            placement = httpx.get(ranks[role] + "/eplb").json()
            assert placement["num_ranks"] == ep, (role, placement)
