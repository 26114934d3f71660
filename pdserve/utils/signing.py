"""HMAC of a msgpack map with the internal token: every process-to-process message of the KV plane
and the encoder wire is signed this way (no token configured: nothing is signed or checked)."""

from __future__ import annotations

import hmac
from typing import Any

from pdserve.protocol import AUTH_FIELD, pack

# What a control map's own fields (ids, sampling parameters, stop strings, a failure's reason, top
# logprobs) take at most, with room to spare: the headroom of every socket's frame limit, above the
# bulk a message may carry (token ids, images, KV, embeddings), which each limit derives.
CONTROL_BYTES = 1 << 20


def _mac(key: bytes, msg: dict[str, Any]) -> str:
    body = {k: v for k, v in msg.items() if k != AUTH_FIELD}
    return hmac.new(key, pack(body), "sha256").hexdigest()


def sign(msg: dict[str, Any], key: bytes | None) -> dict[str, Any]:
    """`msg` with its HMAC added (unchanged when no token is configured)."""
    if key is None:
        return msg
    return {**msg, AUTH_FIELD: _mac(key, msg)}


def verified(msg: dict[str, Any], key: bytes | None) -> bool:
    """Whether `msg` (as unpacked) was signed with `key`; always true when no token is configured.
    msgpack round-trips every value we send exactly, so the body re-packs to the bytes signed."""
    if key is None:
        return True
    given = msg.get(AUTH_FIELD)
    return isinstance(given, str) and hmac.compare_digest(given, _mac(key, msg))


def token_key(token: str | None) -> bytes | None:
    return token.encode() if token else None
