"""Expert-parallel ranks that join from another host (`pdserve ep-rank`, model.ep_rendezvous): here
on loopback, as real processes that load their own copy of the model and keep their own KV pools
(model/ep_kv.py). tests/cluster/test_cluster_ep.py runs them across network namespaces."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
from ep_runs import PARAMS, PROMPTS, assert_same

from pdserve import LLM, SamplingParams
from pdserve.bench.procs import free_port, pdserve_cmd
from pdserve.eplb.placement import slot_range
from pdserve.model.ep_hosts import publish_spec, read_spec, rendezvous_store
from pdserve.model.loader import load_model_files

# Chunked prefills beside decodes, and a pool small enough that blocks are handed out again.
ENGINE = dict(threads=1, device_blocks=48, max_num_batched_tokens=24)


def _ep_rank(name: str, rank: int, world: int, local: int, rendezvous: str, *extra: str) -> subprocess.Popen:
    cmd = pdserve_cmd() + ["ep-rank", "--rank", str(rank), "--model", name, "--threads", "1"]
    cmd += ["--expert-parallel", str(world), "--ep-local-ranks", str(local), "--ep-rendezvous", rendezvous]
    return subprocess.Popen(cmd + list(extra))


class _Deployment:
    """Rank 0 (an offline LLM) with ranks `local..world-1` as `pdserve ep-rank` processes."""

    def __init__(self, name: str, world: int, local: int, **kw) -> None:
        rendezvous = f"127.0.0.1:{free_port()}"
        self.ranks = [_ep_rank(name, r, world, local, rendezvous) for r in range(local, world)]
        try:
            self.llm = LLM(
                model=name,
                loaded=load_model_files(name),
                **ENGINE,
                model__expert_parallel=world,
                model__ep_local_ranks=local,
                model__ep_rendezvous=rendezvous,
                **kw,
            )
        except BaseException:
            self.kill()
            raise
        self.model = self.llm.engine.model

    def kill(self) -> None:
        for p in self.ranks:
            p.kill()
            p.wait(10)

    def close(self) -> list[int]:
        """Stop rank 0; returns the other hosts' ranks' exit codes."""
        self.llm.engine.close()
        try:
            return [p.wait(30) for p in self.ranks]
        finally:
            self.kill()


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,world,local,overlap",
    [
        ("tiny-mixtral", 2, 1, False),
        ("tiny-deepseek-v3", 3, 2, False),
        ("tiny-qwen3-moe", 2, 1, False),
        ("tiny-qwen3-moe", 3, 1, True),
    ],
)
def test_ranks_of_other_hosts_give_ep1_tokens(name, world, local, overlap):
    """EP across hosts: greedy tokens and logprobs equal EP=1's, again on prefix-cache hits (blocks
    computed by one rank, read by another), with KV sent to the ranks and mirrored back. With two
    micro-batches (the ranks read model.ep_overlap from rank 0's spec) gloo's all-to-alls are in
    flight while the other micro-batch computes."""
    want = LLM(model=name, loaded=load_model_files(name), **ENGINE).generate(PROMPTS, PARAMS)
    d = _Deployment(name, world, local, model__ep_overlap=overlap)
    try:
        assert d.model.private
        # The balancer places replicas host by host where the hosts hold equal shares of the ranks.
        assert d.model.eplb.num_nodes == (world // local if world % local == 0 else 1)
        assert_same(d.llm.generate(PROMPTS, PARAMS), want)
        ex = d.model.exchange
        assert ex.dispatch_rows > 0 and ex.kv_mirrored_bytes > 0
        assert_same(d.llm.generate(PROMPTS[::-1], PARAMS), want[::-1])  # cached prefixes, other ranks
        assert ex.kv_shipped_bytes > 0  # some sequence ran where its cached blocks were not
        d.llm.engine.pool.check_integrity()
    finally:
        assert d.close() == [0] * (world - local)


@pytest.mark.slow
@pytest.mark.parametrize("quant,world,local", [("none", 3, 2), ("int4", 2, 1)])
def test_expert_moves_across_hosts_keep_outputs(quant, world, local):
    """Placements forced mid-generation move experts on every rank: the ranks span hosts, so none
    holds every expert (rank 0 and the rank it spawned on its host included); each fetches what it
    lacks from a rank holding it (int4: packed tensors and scales). int4 runs on torch's products:
    the native kernels' bfloat16 activations make a row depend on its step's rows."""
    name = "tiny-mixtral"
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    common = dict(model__quantization=quant, model__gemm_kernel="torch" if quant != "none" else "auto")
    ref = LLM(model=name, loaded=load_model_files(name), **ENGINE, **common)
    want = [o.token_ids for o in ref.generate(PROMPTS, params)]
    slots = 16 + 4
    d = _Deployment(name, world, local, model__num_redundant_experts=4, **common)
    g = torch.Generator().manual_seed(5)
    try:
        rank0 = d.model.model
        assert rank0.expert_store is None
        assert all(len(b.placement.gate_up) == len(range(*slot_range(slots, 0, world))) for b in rank0.blocks)
        engine = d.llm.engine
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), d.llm.tokenizer.encode(p), params)
        outputs: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
        step = 0
        while engine.has_unfinished():
            if step in (4, 16):
                layers = rank0.phy2log.shape[0]
                d.model.request_placement(
                    torch.stack(
                        [
                            torch.cat(
                                [torch.randperm(16, generator=g), torch.randint(0, 16, (4,), generator=g)]
                            )
                            for _ in range(layers)
                        ]
                    )
                )
            for out in engine.step():
                outputs[out.request_id] += out.new_token_ids
            step += 1
        assert [outputs[str(i)] for i in range(len(PROMPTS))] == want
        assert d.model.eplb.rebalances >= 2 and d.model.experts_sent_bytes > 0
    finally:
        assert d.close() == [0] * (world - local)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_lost_rank_of_another_host_fails_the_engine_by_its_deadline(how):
    """A rank that dies (its connection closes) or goes silent (SIGSTOP: what a cut link looks like)
    fails the idle engine's health by the heartbeat's answer, and the next step raises, not hangs."""
    # A deadline short enough to keep the test quick, long enough that a loaded machine's healthy
    # rank always answers within it.
    d = _Deployment("tiny-mixtral", 2, 1, model__ep_timeout_s=10)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    try:
        assert len(d.llm.generate(PROMPTS[:1], params)[0].token_ids) == 4
        os.kill(d.ranks[0].pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        # Heartbeats every 2 s, each answered within the deadline: the failure shows while idle.
        deadline = time.monotonic() + 60
        while d.model.failure() is None:
            assert time.monotonic() < deadline, "a lost rank went unnoticed"
            time.sleep(0.2)
        with pytest.raises(RuntimeError, match="rank failed"):
            d.llm.generate(PROMPTS[:1], params)
    finally:
        d.kill()
        d.llm.engine.close()


def test_the_rendezvous_is_named_by_the_internal_token():
    """A process without the deployment's token finds no spec to join with (it waits out its deadline)."""
    address = f"127.0.0.1:{free_port()}"
    rank0 = rendezvous_store(address, "secret", True, timeout_s=5)
    arch = load_model_files("tiny-mixtral").arch
    publish_spec(rank0, {"world": 2}, arch, torch.zeros(1, 4, dtype=torch.long))
    assert read_spec(rendezvous_store(address, "secret", False, timeout_s=5))["world"] == 2
    stranger = rendezvous_store(address, "guess", False, timeout_s=1)
    with pytest.raises(Exception):
        read_spec(stranger)


def _refused(*args: str) -> str:
    """`pdserve ep-rank` of tiny-mixtral at EP=2 with `args`, without an internal token: exit 2, and
    what it printed."""
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_INTERNAL_TOKEN"}
    cmd = pdserve_cmd() + ["ep-rank", "--model", "tiny-mixtral", "--expert-parallel", "2", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    return r.stderr


def test_ep_rank_refuses_a_rank_that_is_not_another_hosts():
    assert "model.ep_rendezvous" in _refused("--rank", "1")
    local = ["--ep-local-ranks", "1"]
    assert "ranks 1..1 join from other hosts" in _refused(
        "--rank", "0", *local, "--ep-rendezvous", "127.0.0.1:29999"
    )
    assert "needs the internal token" in _refused("--rank", "1", *local, "--ep-rendezvous", "10.0.0.2:29999")


@pytest.mark.parametrize("name,tied", [("tiny-qwen2", False), ("tiny-llama", True)])
def test_a_rank_of_another_host_drops_an_untied_output_head(name, tied):
    """Rank 0 runs the output head over every rank's final rows, so `pdserve ep-rank` lets an untied
    head go (vocab x hidden values fewer resident); a tied head is the embedding and stays."""
    from pdserve.model.loader import build_model

    model = build_model(load_model_files(name))
    a = model.arch
    before = model.resident_weight_bytes()
    rows = torch.randn(2, a.hidden_size)
    want = model.head(rows)
    model.drop_head()
    assert before - model.resident_weight_bytes() == (0 if tied else a.vocab_size * a.hidden_size * 4)
    if tied:
        assert torch.equal(model.head(rows), want)
    else:
        with pytest.raises(RuntimeError, match="dropped"):
            model.head(rows)
