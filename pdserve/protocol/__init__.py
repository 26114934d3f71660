"""The only types that cross a process boundary: the OpenAI-compatible HTTP API and worker-to-worker messages."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Literal

import msgpack
from pydantic import BaseModel, ConfigDict, Field

# The OpenAI-compatible API's types live in protocol/openai.py; importers name them from here.
from pdserve.protocol.openai import (  # noqa: F401 (re-exported)
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    ErrorBody,
    ErrorResponse,
    ImageURL,
    OpenAIModel,
    StreamOptions,
    Tool,
    Usage,
    model_card,
    new_id,
    now,
)

# ---------------------------------------------------------------------- PD disaggregation (worker to worker)
# Control messages are msgpack maps with a "type"; KV bytes travel as raw frames (tcp) or are written
# straight into the decode worker's shared-memory pool (shm). Nothing is pickled.

PD_PREFILL = "prefill"  # decode -> prefill: fill these blocks of mine (a PrefillJob)
PD_CANCEL = "cancel"  # decode -> prefill: stop writing into my blocks
PD_ACCEPTED = "accepted"  # prefill -> decode: the job is queued
PD_STARTED = "started"  # prefill -> decode: the first chunk is computing
PD_LAYER = "layer"  # prefill -> decode: a layer's blocks are written (shm) or attached (tcp)
PD_DONE = "done"  # prefill -> decode: every layer is written; carries the first token
PD_FAILED = "failed"  # prefill -> decode: the job cannot complete
PD_CANCEL_ACK = "cancel_ack"  # prefill -> decode: nothing more will be written for this request
PD_CHUNK_LAYER = "chunk_layer"  # prefill -> prefill: a layer of every earlier chunk is in the decode pool
# Every PD message names its transfer ("transfer_id", random per job): a message for a transfer the
# receiver never started or already ended is dropped. With an internal token configured each one
# also carries AUTH_FIELD, an HMAC of the rest (disagg/trust.py).
AUTH_FIELD = "auth"
# PD_FAILED's "code" when the job was refused before it ran: the decode worker fails the request
# (incompatible, too_long) or tries another peer (the others).
PD_UNAUTHORIZED = "unauthorized"  # no or a wrong internal token
PD_INCOMPATIBLE = "incompatible"  # the compatibility digests differ
PD_TOO_LONG = "too_long"  # the prompt does not fit the decode worker's context
PD_BAD_JOB = "bad_job"  # a duplicate transfer id, a pool path it did not create, ...
# The job ran and its own step failed (its sampling values, say): another peer would fail it too,
# and the peer is no less healthy for it, so the decode worker ends the request.
PD_REQUEST_FAILED = "request_failed"


@dataclass
class PrefillJob:
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams fields
    cache_salt: str | None
    dst_block_ids: list[int]  # the decode worker's blocks for the whole prompt
    dst_start_block: int  # blocks before this one the decode worker has cached already
    reply_endpoint: str  # the decode worker's control/KV socket
    decode_pid: int
    decode_host: str
    shm_path: str | None  # the decode worker's shared pool, if it has one
    # The decode pool's shape: [layers, 2, slots, kv_heads, head_dim], or with MLA [layers, 1, slots, 1, latent].
    kv_shape: list[int]
    elem_size: int
    block_size: int
    model: str
    # transfer.backend mooncake / nixl: the decode side's Mooncake session ("host:rpc_port") or NIXL
    # agent metadata, and the address of its registered pool, which the prefill worker writes into.
    mooncake_session: str | None = None
    nixl_metadata: bytes | None = None
    pool_base: int = 0
    # Tokens the request generated before (a migrated stream, a preempted request): computed with
    # the prompt, and the token sampled is output number len(output_token_ids).
    output_token_ids: list[int] = field(default_factory=list)
    transfer_id: str = ""  # random per job; the prefill worker refuses one it has seen
    issued_at: float = 0.0  # the decode worker's time.time() (a signed job expires)
    max_model_len: int = 0  # the decode worker's context: a longer prompt is refused
    compat: dict[str, Any] | None = None  # trust.compat_info of the decode worker
    # A vision-language prompt's images (common/images.ImageInput.to_wire: positions, digest, file
    # bytes): the prefill worker has them encoded by its encoder workers.
    images: list[dict[str, Any]] = field(default_factory=list)
    traceparent: str | None = None  # W3C trace context of the decode side's transfer span (tracing on)
    # A long prompt prefilled by a pipeline of workers (disagg/pipeline.py): the first
    # `upstream_tokens` tokens' KV is written into the decode pool by the workers of the earlier
    # chunks, layer by layer; this job copies each layer from there once told it is in (ChunkLayer).
    upstream_tokens: int = 0
    # Where to tell, after each layer of this chunk is in the decode pool: the next chunk's worker
    # (its bootstrap endpoint) and that job's transfer id.
    downstream_endpoint: str | None = None
    downstream_transfer_id: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"type": PD_PREFILL, **asdict(self)}

    @classmethod
    def from_wire(cls, msg: dict[str, Any]) -> PrefillJob:
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = required - msg.keys()
        if missing:
            raise ValueError(f"prefill job lacks {sorted(missing)}")
        return cls(**{k: msg[k] for k in names if k in msg})


def pack(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    msg = msgpack.unpackb(data, raw=False)
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ValueError("a control message must be a map with a type")  # noqa: TRY004
    return msg


# ---------------------------------------------------------------- KV events (worker -> router)
# Msgpack on the wire: a PUB message is [b"kv", packb(KVEventBatch.model_dump())]; a snapshot reply
# is packb(KVSnapshot.model_dump()). Block hashes travel as hex strings.

KVTier = Literal["device", "host", "disk", "remote"]
KV_TIERS: tuple[str, ...] = ("device", "host", "disk", "remote")  # fastest first
KVEventType = Literal["stored", "removed"]


class KVEvent(BaseModel):
    type: KVEventType
    block_hashes: list[str]
    parent_hash: str | None = None  # of the first block, for "stored" chains; None when unknown
    tier: KVTier = "device"
    worker_id: str
    seq: int  # +1 per event; starts at the worker's start time in µs, so it
    ts: float  # keeps growing across restarts and a gap means lost events


class KVEventBatch(BaseModel):
    worker_id: str
    events: list[KVEvent]


class KVSnapshot(BaseModel):
    worker_id: str
    seq: int  # the last event whose effect `blocks` includes
    blocks: dict[str, list[KVTier]]  # block hash -> the tiers that hold it


# ---------------------------------------------------------------------- router to worker (HTTP, JSON)

INTERNAL_TOKEN_HEADER = "x-pdserve-internal-token"


class InternalGenerateRequest(BaseModel):
    """The router's request to a decode (or mixed) worker: token ids in, token ids out (NDJSON lines of
    `{"token_ids", "logprobs", "finished", "finish_reason"}`; the first line also carries
    `"prefilled_by"` and `"prefill_failed"`, bootstrap endpoints of prefill workers, when any was
    asked to prefill); text, stop strings and the OpenAI format are the router's business."""

    model_config = ConfigDict(extra="forbid")
    request_id: str
    prompt_token_ids: list[int] = Field(min_length=1)
    # Tokens the request already generated on a worker that died (a migrated stream): the worker
    # recomputes them with the prompt and continues as output token len(output_token_ids).
    output_token_ids: list[int] = Field(default_factory=list)
    sampling: dict[str, Any] = Field(default_factory=dict)
    cache_salt: str | None = None
    # A VLM prompt's images (common/images.ImageInput.to_json: positions, file bytes in base64).
    images: list[dict[str, Any]] = Field(default_factory=list)


class WorkerRegistration(BaseModel):
    model_config = ConfigDict(extra="ignore")
    worker_id: str
    role: Literal["prefill", "decode", "mixed"]
    url: str
    model: str
    pid: int | None = None
    kv_endpoint: str | None = None
    capacity: int = 64
    pdserve_version: str | None = None  # its version label's parts (pdserve/version.py)
    config_digest: str | None = None
