"""A request is one thing with `num_computed_tokens`: prefill and decode are scheduling facts."""

from __future__ import annotations

import enum
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.cache.prefix_cache import salt_key
from pdserve.common.images import ImageInput
from pdserve.common.outputs import TokenLogprob  # noqa: F401 (re-exported: engine code imports it from here)
from pdserve.common.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LOADING = "loading"  # holds blocks whose KV a peer (prefill worker, lower tier) is filling
    FINISHED = "finished"


_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for draw `index` of a request seeded with `seed` (splitmix64's
    finalizer: neighbouring indices give unrelated streams)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


# Identity, not value, equality: `in` and `remove` over the scheduler's queues compared every field,
# token lists included, ~0.7 ms a step at 32 streams.
@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Prompt + output. A preempted request recomputes all of it, so both live in one list.
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort
    num_preemptions: int = 0
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # left the waiting queue the first time (metrics)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    sample_seed: int | None = None  # None when greedy; see `draw_generator`
    cache_salt: str | None = None  # tenants with different salts never share cached blocks
    salt_key: bytes | None = field(init=False, default=None)  # the salt as block hashes take it
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks so far
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    swapped_tokens: int = 0  # preempted: tokens whose KV waits in host swap space (cache/swap.py)
    recompute_until: int = 0  # preempted without swap: positions below this are computed again
    prefill_peers: list[str] = field(default_factory=list)  # decode role: prefill workers to try, in order
    # Decode role, reported to the router with the first token (it keeps each prefill worker's
    # load and circuit breaker): the peers asked to prefill, in order, and the one whose KV this
    # request holds (None: it was computed here, after every peer failed or none was asked).
    prefill_attempts: list[str] = field(default_factory=list)
    prefilled_by: str | None = None
    kv_sink: Any = None  # prefill role: where this request's KV is written (disagg.sink.KVSink)
    # Prefill role, one chunk of a pipelined prompt: the leading tokens whose KV earlier chunks'
    # workers supply, layer by layer, while this request's first step computes (disagg/pipeline.py).
    upstream_tokens: int = 0
    images: list[ImageInput] = field(default_factory=list)  # a VLM prompt's images (common/images.py)
    # Asked for (params.prompt_logprobs) on a fresh request: one entry per prompt token so far, None
    # for the first; filled as the prompt is computed here (never from a cache: see collects_prompt).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Speculative decoding: draft tokens proposed for this step, computed after the last token and
    # verified by the step's logits (engine/spec_decode.py); never part of all_token_ids.
    draft_tokens: list[int] = field(default_factory=list)
    spec_hits: int = 0  # draft tokens accepted so far
    spec_misses: int = 0  # verifications that rejected a draft token
    # A constrained request's matcher (engine/grammar.py GrammarState), built where it first samples.
    grammar: Any = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        self.salt_key = salt_key(self.cache_salt)
        if not self.params.greedy:
            self.sample_seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def draw_generator(self) -> torch.Generator:
        """The generator for drawing output token number len(output_token_ids): a function of the
        seed and that index only, so a request that continues elsewhere (the decode worker after the
        prefill worker drew the first token, a stream migrated after its worker died) draws exactly
        what it would have drawn where it started, with no generator state to carry."""
        return torch.Generator().manual_seed(draw_seed(self.sample_seed or 0, len(self.output_token_ids)))

    @property
    def collects_prompt(self) -> bool:
        """Its prompt's logprobs are still being computed: every prompt position runs the model
        here (no prefix-cache hit, no tier fetch, no remote prefill), so each gives its logits."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
