"""The PD control messages between a decode and a prefill worker (pdserve/disagg), one type each.

On the wire each is a msgpack map with its "type" (protocol.pack of `to_wire()`, signed first when
an internal token is set: disagg/trust.py signs and verifies the map); `decode_pd` turns a verified
map back into its type. The job itself, decode -> prefill, is `PrefillJob` (protocol/__init__.py).
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from pdserve.protocol import (
    PD_ACCEPTED,
    PD_CANCEL,
    PD_CANCEL_ACK,
    PD_CHUNK_LAYER,
    PD_DONE,
    PD_FAILED,
    PD_LAYER,
    PD_STARTED,
)


@dataclass
class PDMessage:
    TYPE: ClassVar[str] = ""
    request_id: str
    transfer_id: str  # random per job: a message for a transfer that is not live is dropped

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": self.TYPE,
            **{f.name: getattr(self, f.name) for f in fields(self) if not f.metadata.get("local")},
        }

    @classmethod
    def from_wire(cls, msg: dict[str, Any]) -> Any:
        """Raises ValueError for a map that lacks a field, or whose ids are not strings."""
        wired = [f for f in fields(cls) if not f.metadata.get("local")]
        missing = [
            f.name
            for f in wired
            if f.default is MISSING and f.default_factory is MISSING and f.name not in msg
        ]
        if missing:
            raise ValueError(f"a {msg.get('type')} message lacks {missing}")
        if not (isinstance(msg["request_id"], str) and isinstance(msg["transfer_id"], str)):
            raise ValueError("a PD message names its request and transfer by strings")
        hints = _hints(cls)
        wrong = [f.name for f in wired if f.name in msg and not _conforms(msg[f.name], hints[f.name])]
        if wrong:  # the engine thread does arithmetic and /proc lookups with these
            raise ValueError(f"a {msg.get('type')} message has {wrong} of the wrong type")
        return cls(**{f.name: msg[f.name] for f in wired if f.name in msg})


_HINTS: dict[str, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls.__name__)
    if hints is None:
        hints = _HINTS[cls.__name__] = typing.get_type_hints(cls)
    return hints


def _conforms(value: Any, hint: Any) -> bool:
    """Whether an unpacked msgpack value has the declared field type (the few shapes used here)."""
    if hint is Any:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_conforms(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


@dataclass
class Cancel(PDMessage):
    """decode -> prefill: stop writing into my blocks (answered by CancelAck)."""

    TYPE: ClassVar[str] = PD_CANCEL
    reply_endpoint: str = ""


@dataclass
class Accepted(PDMessage):
    """prefill -> decode: the job is queued; the decode side watches this process from now on."""

    TYPE: ClassVar[str] = PD_ACCEPTED
    pid: int | None = None
    host: str | None = None


@dataclass
class Started(PDMessage):
    """prefill -> decode: the job's first chunk is computing."""

    TYPE: ClassVar[str] = PD_STARTED


@dataclass
class LayerWritten(PDMessage):
    """prefill -> decode: a step's writes are in the decode pool (shm, mooncake, nixl) or sent (tcp)
    up to this block."""

    TYPE: ClassVar[str] = PD_LAYER
    upto_block: int
    data: bool = False


@dataclass
class LayerFrames(PDMessage):
    """prefill -> decode over tcp: the header of one layer's KV frames, which follow it in the same
    multipart message; `runs` are [first destination block, count] pairs."""

    TYPE: ClassVar[str] = PD_LAYER
    layer: int
    runs: list[list[int]]
    data: bool = True
    received_bytes: int = field(default=0, metadata={"local": True})  # counted on arrival, never sent


@dataclass
class Done(PDMessage):
    """prefill -> decode: every layer is written; the first token sampled (and its logprob entry)."""

    TYPE: ClassVar[str] = PD_DONE
    token: int
    logprob: list[Any] | None = None  # TokenLogprob.to_wire()
    bytes: int = 0
    seconds: float = 0.0
    # Asked for (prompt_logprobs, echo with logprobs): one entry per prompt token, None for the first.
    prompt_logprobs: list[Any] | None = None


@dataclass
class Failed(PDMessage):
    """prefill -> decode: the job cannot complete; `code` (protocol's PD_* codes) when it was refused
    before it ran."""

    TYPE: ClassVar[str] = PD_FAILED
    reason: str = ""
    code: str | None = None


@dataclass
class CancelAck(PDMessage):
    """prefill -> decode: nothing more will be written for this transfer."""

    TYPE: ClassVar[str] = PD_CANCEL_ACK


@dataclass
class ChunkLayer(PDMessage):
    """prefill -> prefill, in a pipeline of chunks: `layer` of every chunk before the receiver's is in
    the decode pool. `transfer_id` is the receiving job's."""

    TYPE: ClassVar[str] = PD_CHUNK_LAYER
    layer: int = 0


_BY_TYPE: dict[str, type[PDMessage]] = {
    c.TYPE: c for c in (Cancel, Accepted, Started, Done, Failed, CancelAck, ChunkLayer)
}


def decode_pd(msg: dict[str, Any]) -> PDMessage:
    """The typed form of a verified control map (not a PrefillJob: PrefillJob.from_wire reads those)."""
    t = msg.get("type")
    if t == PD_LAYER:
        return (LayerFrames if msg.get("data") else LayerWritten).from_wire(msg)
    cls = _BY_TYPE.get(t)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown PD message type {t!r}")
    return cls.from_wire(msg)
