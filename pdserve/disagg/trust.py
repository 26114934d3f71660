"""What the KV plane checks before it acts on a peer's message.

- Authentication: with an internal token configured, every control message (and every tcp layer
  header) carries an HMAC-SHA256 of its msgpack body keyed with the token; the token itself never
  crosses the wire. Without a token (the laptop default) nothing is signed or checked.
- Compatibility: each job carries the decode side's model, dtype, quantization, block size, KV
  layout and pdserve version; a prefill worker refuses a job whose values differ from its own.
- Freshness: transfer ids are random per job; a prefill worker refuses one it has seen (a replay),
  and, when signing, a job issued too long ago.
- Bounds: a job may name only the decode worker's own shm pool and blocks inside it; no socket
  takes a frame larger than a legitimate message can be (`job_bytes_limit`, `kv_frame_limit`);
  a peer's token ids must lie in the vocabulary (`done_problem`).
- Silence: a message that fails the HMAC check is never answered (the answer would go where an
  unauthenticated sender chose).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
import time
from collections import OrderedDict
from typing import Any

from pdserve import __version__
from pdserve.cache.kv_cache import SHM_DIR, is_pool_path
from pdserve.common.outputs import TokenLogprob
from pdserve.config import VisionConfig
from pdserve.protocol import PD_BAD_JOB, PD_INCOMPATIBLE, PD_TOO_LONG, PrefillJob
from pdserve.protocol.pd import Done
from pdserve.utils.signing import CONTROL_BYTES

# A signed job older (or newer) than this by the prefill worker's clock is refused: past it, its
# transfer id may have left the replay memory. Generous, so clock skew between hosts is no issue.
REPLAY_WINDOW_S = 600.0


BAD_TOKEN = (
    "no or a wrong internal token; every worker needs the same server.internal_token (PDSERVE_INTERNAL_TOKEN)"
)


_INT_BYTES = 9  # the most msgpack spends on one integer


def job_bytes_limit(max_tokens: int, block_size: int, vision: VisionConfig) -> int:
    """The largest frame a prefill worker's bootstrap socket takes: a job of `max_tokens` token ids
    (prompt and earlier output) with one block id per block, at most vision.max_images images of
    vision.max_image_bytes, and the control fields."""
    ids = max_tokens + -(-max_tokens // block_size)
    return _INT_BYTES * ids + vision.max_images * vision.max_image_bytes + CONTROL_BYTES


def kv_frame_limit(pool_slots: int, slot_bytes: int, block_size: int, max_model_len: int) -> int:
    """The largest frame a decode worker's socket takes: one tcp KV frame is one run of one layer's K
    or V, which cannot span more than this pool, nor more blocks than a request of its context has
    (`max_model_len` 0: unknown); or a control message."""
    slots = (
        pool_slots if max_model_len <= 0 else min(pool_slots, -(-max_model_len // block_size) * block_size)
    )
    return max(slots * slot_bytes, CONTROL_BYTES)


def done_problem(msg: Done, vocab_size: int, prompt: list[int] | None = None) -> str | None:
    """What makes a peer's PD_DONE unusable (its token would index the embedding table), or None.
    `prompt`: the request's prompt when it asked for prompt logprobs (one entry per token, each of
    the token it follows; the first None)."""
    token = msg.token
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
        return f"a first token {token!r} outside the vocabulary (0..{vocab_size - 1})"
    if msg.logprob is not None and _entry_problem(msg.logprob, token, vocab_size):
        return "a malformed logprob entry, or one of other tokens or tokens outside the vocabulary"
    if prompt is not None:
        entries = msg.prompt_logprobs
        if (
            not isinstance(entries, list)
            or len(entries) != len(prompt)
            or (entries and entries[0] is not None)
        ):
            return "prompt logprobs that are not one entry per prompt token"
        if any(_entry_problem(e, t, vocab_size) for e, t in zip(entries[1:], prompt[1:])):
            return "a malformed prompt logprob entry"
    return None


def _entry_problem(entry: Any, token: int, vocab_size: int) -> bool:
    try:
        lp = TokenLogprob.from_wire(entry)
    except (TypeError, ValueError):
        return True
    return lp.token_id != token or any(not 0 <= t < vocab_size for t, _ in lp.top)


log = logging.getLogger(__name__)


def warn_if_open(bound_endpoint: str, key: bytes | None) -> None:
    """Without a token nothing on the KV plane is authenticated: right on loopback (the default bind,
    `pdserve serve`), worth a warning on any other address."""
    host = bound_endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost" or not bound_endpoint.startswith("tcp://")
    if key is None and not loopback:
        log.warning(
            "the KV socket %s takes jobs and KV from any host that reaches it: no internal token is "
            "set (server.internal_token or PDSERVE_INTERNAL_TOKEN, the same on every worker)",
            bound_endpoint,
        )


def compat_info(
    model: str,
    dtype: str,
    quantization: str,
    block_size: int,
    kv_shape: list[int],
    elem_size: int,
    kv_layout: str = "",
) -> dict[str, Any]:
    """What both ends of a transfer must agree on for the bytes to mean the same KV. `kv_layout`:
    ModelArch.kv_layout_name (K/V heads, or MLA's latent and rope widths)."""
    layers, planes, _, kv_heads, head_dim = kv_shape
    return {
        "model": model,
        "dtype": dtype,
        "quantization": quantization,
        "block_size": block_size,
        "kv_layers": layers,
        "kv_planes": planes,
        "kv_layout": kv_layout,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "kv_elem_size": elem_size,
        "pdserve_version": __version__,
    }


# Carried but allowed to differ: weight quantization changes no KV layout, and a deployment may quantize
# its decode role alone (deployment_plan.py accepts per-role quantization; pd_kv_dtype gives both one dtype).
_MAY_DIFFER = frozenset({"quantization"})


def compat_mismatch(mine: dict[str, Any], theirs: Any) -> str | None:
    """A readable list of the differences, or None when the two agree."""
    if not isinstance(theirs, dict):
        return "the job carries no compatibility information (a pdserve version without it?)"
    diffs = [
        f"{k} {theirs.get(k)!r} (decode) != {v!r} (prefill)"
        for k, v in mine.items()
        if k not in _MAY_DIFFER and theirs.get(k) != v
    ]
    if theirs.get("kv_elem_size") != mine.get("kv_elem_size"):
        # Workers started apart, each resolving `auto` from its own quantization flag.
        diffs.append("set cache.kv_dtype (--kv-cache-dtype) the same on both")
    return "; ".join(diffs) or None


class SeenIds:
    """Transfer ids seen in the last `window_s` seconds (a prefill worker's replay memory)."""

    def __init__(self, window_s: float = REPLAY_WINDOW_S, clock=time.monotonic) -> None:
        self.window_s, self.clock = window_s, clock
        self._seen: OrderedDict[str, float] = OrderedDict()

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._seen

    def add(self, transfer_id: str) -> bool:
        """Record the id; False if it was seen already."""
        now = self.clock()
        while self._seen and next(iter(self._seen.values())) < now - self.window_s:
            self._seen.popitem(last=False)
        if transfer_id in self._seen:
            return False
        self._seen[transfer_id] = now
        return True


class ThrottledLog:
    """Logs a peer's bad messages at most once a second (with the count suppressed meanwhile), so a
    flood of them cannot flood the log."""

    def __init__(self, logger: logging.Logger, period_s: float = 1.0) -> None:
        self.log, self.period_s = logger, period_s
        self._last = -period_s
        self._suppressed = 0

    def __call__(self, level: int, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.period_s:
            self._suppressed += 1
            return
        if self._suppressed:
            fmt += f" ({self._suppressed} similar messages suppressed)"
        self._last, self._suppressed = now, 0
        self.log.log(level, fmt, *args)


class JobRefused(Exception):
    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code  # PD_FAILED's code


def check_job(job: PrefillJob, compat: dict[str, Any], signed: bool, seen: SeenIds, now_wall: float) -> None:
    """Raise JobRefused when a prefill worker must not run `job`; checked before anything is
    allocated or computed."""
    refused = _refusal(job, compat, signed, seen, now_wall)
    if refused:
        raise JobRefused(*refused)


def _refusal(
    job: PrefillJob, compat: dict[str, Any], signed: bool, seen: SeenIds, now_wall: float
) -> tuple[str, str] | None:
    if not job.transfer_id or not isinstance(job.transfer_id, str):
        return PD_BAD_JOB, "the job has no transfer id"
    if signed and abs(now_wall - job.issued_at) > REPLAY_WINDOW_S:
        return PD_BAD_JOB, (
            f"the job was issued {now_wall - job.issued_at:.0f} s from now: expired "
            "(or the two hosts' clocks are far apart)"
        )
    diff = compat_mismatch(compat, job.compat)
    if diff:
        return PD_INCOMPATIBLE, f"prefill and decode workers are incompatible: {diff}"
    n = len(job.prompt_token_ids) + len(job.output_token_ids)
    if job.max_model_len and n >= job.max_model_len:
        return (
            PD_TOO_LONG,
            f"the context ({n} tokens) leaves no room in the decode worker's {job.max_model_len}",
        )
    if job.shm_path and not (is_pool_path(job.shm_path, job.decode_pid) and _plain_or_absent(job.shm_path)):
        return PD_BAD_JOB, (
            f"{job.shm_path!r} is not a KV pool the decode worker created "
            f"({SHM_DIR}/pdserve-kv-<its pid>-<hex>)"
        )
    shape = job.kv_shape
    if not (
        isinstance(shape, list)
        and len(shape) == 5
        and all(type(x) is int and x > 0 for x in shape)
        and [shape[0], shape[1], shape[3], shape[4], job.elem_size, job.block_size]
        == [
            compat["kv_layers"],
            compat["kv_planes"],
            compat["kv_heads"],
            compat["head_dim"],
            compat["kv_elem_size"],
            compat["block_size"],
        ]
    ):
        # The pool the job's blocks and KV writes are measured against: the compat digest alone could differ.
        return PD_BAD_JOB, f"the job's decode pool shape {str(shape)[:80]} does not fit this model's KV"
    if (
        any(type(b) is not int or not 0 <= b < shape[2] // job.block_size for b in job.dst_block_ids)
        or not 0 <= job.dst_start_block <= len(job.dst_block_ids)
        or not 0 <= job.upstream_tokens
    ):
        return PD_BAD_JOB, "the job names blocks outside the decode pool"
    if not seen.add(job.transfer_id):
        return PD_BAD_JOB, f"transfer id {job.transfer_id} was used before"
    return None


def _plain_or_absent(path: str) -> bool:
    """A regular file, or nothing (the pool of a decode worker on another host: never opened here).
    ShmWriter opens it with O_NOFOLLOW too, in case a symlink appears after this check."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return True
