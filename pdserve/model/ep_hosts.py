"""Expert-parallel ranks on several hosts: where they meet, and what rank 0 tells them.

Rank 0 serves a TCP store at model.ep_rendezvous (host: rank 0's own address on the network the
hosts share; the port is the store's). Its ranks on this host and `pdserve ep-rank` on the others
connect to it; gloo then connects every pair of ranks directly, each rank on the address it reaches
rank 0 from. The store's keys live under a name derived from the internal token, so a process that
does not hold the token finds nothing to join; like the KV plane, the ranks' traffic belongs on the
deployment's own network.

Rank 0 writes the rank spec (`publish_spec`): the values every rank must share (dtype, quantization,
kernels, context length, threads, the expert placement) as JSON, and the model's architecture, which
a rank that loaded its own copy of the model checks against its own before it joins.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import json
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pdserve.model.arch import ModelArch

START_TIMEOUT_S = 300.0  # ranks of other hosts load their model before they join: minutes, not seconds
SPEC_KEY = "spec"


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def local_ranks(world: int, ep_local_ranks: int | None) -> int:
    """Ranks on rank 0's host (model.ep_local_ranks; unset, or world and above: every rank)."""
    return min(world, ep_local_ranks or world)


def rendezvous_problem(address: str | None, token: str | None) -> str | None:
    """Why ranks may not meet at `address` (a message), or None: off loopback the internal token
    names the rendezvous, so without one any process could join."""
    if address and not token and not is_loopback(split_address(address)[0]):
        return (
            "model.ep_rendezvous off loopback needs the internal token (server.internal_token or "
            "PDSERVE_INTERNAL_TOKEN): it names the rendezvous, so only the deployment's ranks join"
        )
    return None


def own_address(peer_host: str) -> str:
    """This host's address on the route to `peer_host` (no packet is sent)."""
    if is_loopback(peer_host):
        return "127.0.0.1"
    family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, 9))
        return s.getsockname()[0]


def rendezvous_store(address: str, token: str | None, rank0: bool, timeout_s: float = START_TIMEOUT_S):
    """Rank 0 serves the store at `address`; the other ranks connect to it (retrying until the
    deadline, so a rank may start before rank 0 does)."""
    host, port = split_address(address)
    store = dist.TCPStore(host, port, None, rank0, timedelta(seconds=timeout_s), wait_for_workers=False)
    name = hashlib.sha256(token.encode()).hexdigest()[:32] if token else "no-token"
    return dist.PrefixStore(f"pdserve-ep/{name}/", store)


def arch_json(arch: ModelArch) -> str:
    return json.dumps(dataclasses.asdict(arch), sort_keys=True, default=str)


def publish_spec(store, values: dict[str, Any], arch: ModelArch, phy2log: torch.Tensor) -> None:
    doc = {**values, "arch": arch_json(arch), "phy2log": phy2log.tolist()}
    store.set(SPEC_KEY, json.dumps(doc))


def read_spec(store) -> dict[str, Any]:
    """Rank 0's spec (waits for it within the store's deadline)."""
    doc = json.loads(store.get(SPEC_KEY))
    doc["phy2log"] = torch.tensor(doc["phy2log"], dtype=torch.long)
    return doc


def check_arch(doc: dict[str, Any], arch: ModelArch) -> None:
    """ValueError naming what differs when this host's model is not rank 0's."""
    theirs, mine = json.loads(doc["arch"]), json.loads(arch_json(arch))
    diff = sorted(k for k in set(theirs) | set(mine) if theirs.get(k) != mine.get(k))
    if diff:
        raise ValueError(
            "this host's model is not rank 0's: "
            + ", ".join(f"{k} {mine.get(k)!r} here, {theirs.get(k)!r} at rank 0" for k in diff[:5])
        )
