"""`pdserve ep-rank`: an expert-parallel rank on a host other than rank 0's.

It loads the model from this host's copy (the same model.name, seed and quantization as the
worker's config), meets rank 0 at model.ep_rendezvous, checks that its model is rank 0's, takes the
values every rank shares from rank 0's spec, builds its slots of the experts and follows rank 0's
steps until rank 0 stops it or is lost; then it exits (a supervisor starts it again for the next
rank 0).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import torch

from pdserve.common.internal_token import internal_token
from pdserve.config import Config
from pdserve.model.ep_hosts import (
    check_arch,
    local_ranks,
    own_address,
    read_spec,
    rendezvous_problem,
    rendezvous_store,
    split_address,
)
from pdserve.model.expert_parallel import RankSpec, join_and_follow, rank_model
from pdserve.model.loader import load_model_files
from pdserve.utils.cpu import feature_key
from pdserve.utils.runtime import memory_status, trim_heap

log = logging.getLogger(__name__)


def check_rank(config: Config, rank: int) -> str | None:
    """Why `rank` cannot join under `config` (a message), or None."""
    mc = config.model
    world = mc.expert_parallel
    local = local_ranks(world, mc.ep_local_ranks)
    if not mc.ep_rendezvous:
        return "model.ep_rendezvous is not set: ranks of other hosts meet rank 0 there"
    if problem := rendezvous_problem(mc.ep_rendezvous, internal_token(config.server.internal_token)):
        return problem
    if not local <= rank < world:
        return (
            f"--rank {rank}: ranks {local}..{world - 1} join from other hosts "
            f"(model.expert_parallel {world}, model.ep_local_ranks {local})"
        )
    return None


def host_ranks(config: Config, pod_index: int) -> list[int]:
    """The ranks of the worker's host number `pod_index` (rank 0's is 0), model.ep_local_ranks each."""
    local = local_ranks(config.model.expert_parallel, config.model.ep_local_ranks)
    return list(range(pod_index * local, (pod_index + 1) * local))


def run_ranks(argv: list[str], ranks: list[int]) -> int:
    """Several ranks on this host: `pdserve ep-rank --rank r` for each (the same arguments
    otherwise), one process each; the first to exit with an error stops the others (the group is
    broken without it) and gives the exit code."""
    base = [a for i, a in enumerate(argv) if not _pod_index_arg(argv, i)]
    procs = [subprocess.Popen([sys.executable, "-m", "pdserve.cli", *base, "--rank", str(r)]) for r in ranks]
    try:
        while True:
            for p in procs:
                code = p.poll()
                if code is not None and (code != 0 or all(q.poll() is not None for q in procs)):
                    return code if code != 0 else max(q.returncode for q in procs)
            time.sleep(0.5)
    finally:
        for p in procs:  # the group is broken without the one that failed: nothing left to drain
            if p.poll() is None:
                p.kill()
            p.wait()


def _pod_index_arg(argv: list[str], i: int) -> bool:
    """argv[i] is --pod-index, its value, or --pod-index=N."""
    a = argv[i]
    return a == "--pod-index" or a.startswith("--pod-index=") or (i > 0 and argv[i - 1] == "--pod-index")


def kernel_paths(doc: dict) -> dict[str, int]:
    """The kernel paths this rank's products take: rank 0's where this CPU has its features (the same
    kernels, so the same bits whichever rank computes a row), else this machine's own tuning (its
    rows' bits may then differ from rank 0's, as they would on any other CPU)."""
    from pdserve.model.kernels import tuning

    if doc.get("kernel_paths") and doc.get("kernel_features") == feature_key():
        return dict(doc["kernel_paths"])
    tuning.tune()  # as the loader does for rank 0: this machine's kernel paths
    if doc.get("kernel_paths"):
        log.warning(
            "expert-parallel rank: this CPU's features differ from rank 0's (%s here, %s there): "
            "its own kernel paths run, so its rows' bits may differ from rank 0's",
            feature_key(),
            doc.get("kernel_features"),
        )
    return {}


def run_rank(config: Config, rank: int) -> int:
    """Join, follow rank 0, and return the exit code: 0 when rank 0 stopped this rank, 1 when the
    group broke (rank 0 or a peer lost, a deadline missed)."""
    mc = config.model
    token = internal_token(config.server.internal_token)
    host = split_address(mc.ep_rendezvous)[0]
    log.info("expert-parallel rank %d: meeting rank 0 at %s", rank, mc.ep_rendezvous)
    store = rendezvous_store(mc.ep_rendezvous, token, False)
    doc = read_spec(store)
    loaded = load_model_files(mc.name, mc.seed, doc["quantization"])
    check_arch(doc, loaded.arch)
    paths = kernel_paths(doc) if mc.device == "cpu" and mc.gemm_kernel != "torch" else {}
    spec = RankSpec(
        loaded.arch,
        getattr(torch, doc["dtype"]),
        mc.device,
        int(doc["max_model_len"]),
        doc["phy2log"],
        rank,
        int(doc["world"]),
        "",
        int(doc["threads"]),
        0,  # no parent to follow: rank 0's heartbeats tell this rank it is alive
        doc["quantization"],
        doc["attention_kernel"],
        doc["gemm_kernel"],
        doc["activation_quantization"],
        timeout_s=float(doc["timeout_s"]),
        rendezvous=mc.ep_rendezvous,
        token=token,
        host=own_address(host),
        local=int(doc["local"]),
        overlap=bool(doc.get("overlap", False)),
        dispatch_dtype=str(doc.get("dispatch_dtype", "model")),
        kernel_paths=paths,
    )
    model, comms = rank_model(spec, loaded.weights)
    del loaded  # the checkpoint's tensors: only what the model keeps stays
    model.keep_own_experts()
    model.drop_head()
    trim_heap()
    mem = memory_status()
    if mem:
        log.info(
            "expert-parallel rank %d: %.1f MB of weights, resident set %.1f MB (peak %.1f MB)",
            rank,
            model.weight_bytes() / 1e6,
            mem[0] / 1e6,
            mem[1] / 1e6,
        )
    try:
        stopped = join_and_follow(spec, model, comms, store)
    except RuntimeError as exc:  # a collective failed: the group is gone, rank 0 fails its worker
        log.error("expert-parallel rank %d: the rank group broke: %s", rank, exc)
        return 1
    log.info("expert-parallel rank %d: %s", rank, "stopped by rank 0" if stopped else "rank 0 is gone")
    return 0 if stopped else 1
