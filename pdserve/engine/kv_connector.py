"""Hooks through which a worker's role plugs into the engine loop (PD disaggregation lives in
pdserve.disagg; the engine only knows these calls). The base class does nothing: a mixed worker."""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine, RequestOutput
    from pdserve.engine.request import Request


def _no_loop() -> None:
    """No engine loop to wake yet."""


class KVConnector:
    # Set by the loop's owner (AsyncEngine): called from any thread when a peer's message arrives.
    wake: Callable[[], None] = staticmethod(_no_loop)

    def poll(self, engine: LLMEngine) -> list[RequestOutput]:
        """Start of each step: apply what peers sent. Returns outputs produced by it (first tokens)."""
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
