"""Hooks through which a worker's role plugs into the engine loop (PD disaggregation lives in
pdserve.disagg; the engine only knows these calls). The base class does nothing: a mixed worker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.common.outputs import TokenLogprob
    from pdserve.common.sampling import SamplingParams
    from pdserve.engine.engine import LLMEngine, RequestOutput
    from pdserve.engine.request import Request


# What a connector's poll reports; LLMEngine.step applies each one on the engine thread, which owns
# every request and every block. `held`: blocks a peer may still write into; they stay allocated
# until the connector hands them back with BlocksFreed.
@dataclass
class LoadDone:
    """A prefill worker filled every prompt block of `req` and sampled its first token."""

    req: Request
    token: int
    logprob: TokenLogprob | None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # computed by the prefill worker


@dataclass
class LoadFailed:
    """No peer or retry would do better (an incompatible peer): `req` ends with `error`."""

    req: Request
    held: list[int]
    error: str


@dataclass
class LoadRetry:
    """The transfer failed: `req` goes back to the head of the queue (next peer, or a local prefill)."""

    req: Request
    held: list[int]


@dataclass
class BlocksFreed:
    """Held blocks no peer can write into any more: back to the pool."""

    blocks: list[int]


@dataclass
class AddJob:
    """A prefill job from a peer: the engine adds it as a request (`kwargs` go to add_request), then
    tells the connector with `accepted()`, or `refused(error)` when the engine turns it down."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kwargs: dict[str, Any]
    accepted: Callable[[], None]
    refused: Callable[[Exception], None]


@dataclass
class AbortJob:
    """A job the peer cancelled, or whose peer died or deadline passed: the engine aborts it."""

    request_id: str


ConnectorEvent = LoadDone | LoadFailed | LoadRetry | BlocksFreed | AddJob | AbortJob


def _no_loop() -> None:
    """No engine loop to wake yet."""


class KVConnector:
    # Set by the loop's owner (AsyncEngine): called from any thread when a peer's message arrives.
    wake: Callable[[], None] = staticmethod(_no_loop)

    def poll(self, engine: LLMEngine) -> list[ConnectorEvent]:
        """Start of each step: what peers sent, as events for the engine to apply (it reads `engine`,
        never calls it)."""
        return []

    def wait(self, timeout: float) -> None:
        """Block until a peer sends something or the timeout passes (the engine has nothing to compute)."""

    def has_work(self) -> bool:
        """Whether the engine must keep stepping for the connector (messages, transfers in flight)."""
        return False

    def order_peers(self, preferred: str | None) -> list[str]:
        """The prefill workers a new request may use, best first (none: it prefills locally)."""
        return []

    def start_load(self, req: Request) -> None:
        """The scheduler gave `req` blocks for its whole prompt; ask a prefill worker to fill them."""

    def cancel_load(self, req: Request) -> list[int]:
        """`req` is leaving while its KV is in flight; returns the blocks that must stay allocated
        until the peer can no longer write into them (the connector frees them later)."""
        return []

    def begin_step(self, scheduled: list[tuple[Request, int]]) -> list[Request]:
        return []

    def on_layer(self, planned: list[Request], layer: int) -> None:
        pass

    def end_step(self, planned: list[Request]) -> None:
        pass

    def failed_requests(self) -> list[str]:
        return []

    def on_finished(self, req: Request, out: RequestOutput) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass
