"""The transfer state machine both sides run: bootstrapping -> waiting -> transferring -> done | failed.

Every non-terminal state has a deadline; `expired` tells the owner to fail the transfer. Pure: the
owner passes the clock in, so tests drive it without sleeping.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class TransferState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # the job is sent (decode) or the destination is being attached (prefill)
    WAITING = "waiting"  # the prefill worker has queued the job
    TRANSFERRING = "transferring"  # layers are being written
    DONE = "done"
    FAILED = "failed"


TERMINAL = (TransferState.DONE, TransferState.FAILED)

# Which event moves which state where. Progress in TRANSFERRING stays there and renews the deadline.
_NEXT = {
    (TransferState.BOOTSTRAPPING, "accepted"): TransferState.WAITING,
    (TransferState.BOOTSTRAPPING, "started"): TransferState.TRANSFERRING,
    (TransferState.WAITING, "started"): TransferState.TRANSFERRING,
    (TransferState.WAITING, "accepted"): TransferState.WAITING,  # a queued job's keepalive
    (TransferState.TRANSFERRING, "progress"): TransferState.TRANSFERRING,
    (TransferState.WAITING, "progress"): TransferState.TRANSFERRING,
    (TransferState.TRANSFERRING, "done"): TransferState.DONE,
    (TransferState.WAITING, "done"): TransferState.DONE,
}


@dataclass(frozen=True)
class Deadlines:
    bootstrap_s: float = 5.0
    queue_s: float = 60.0
    transfer_s: float = 10.0
    # The decode side's limit on a queued job's silence: its prefill peer re-sends "accepted" while
    # the job waits there, so a peer that went silent (partitioned, stopped) is given up after this
    # long, not after the whole queue_s. None (the prefill side): queue_s alone.
    silence_s: float | None = None

    def for_state(self, state: TransferState) -> float | None:
        waiting = self.queue_s if self.silence_s is None else min(self.queue_s, self.silence_s)
        return {
            TransferState.BOOTSTRAPPING: self.bootstrap_s,
            TransferState.WAITING: waiting,
            TransferState.TRANSFERRING: self.transfer_s,
        }.get(state)


class InvalidTransition(ValueError):
    pass


@dataclass
class Transfer:
    request_id: str
    deadlines: Deadlines
    now: float
    state: TransferState = TransferState.BOOTSTRAPPING
    started_at: float = 0.0
    deadline: float | None = None
    reason: str | None = None  # why it failed
    waiting_since: float = 0.0
    history: list[TransferState] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.started_at = self.now
        self._enter(self.state, self.now)

    def _enter(self, state: TransferState, now: float) -> None:
        self.state = state
        self.history.append(state)
        limit = self.deadlines.for_state(state)
        self.deadline = None if limit is None else now + limit

    def on(self, event: str, now: float) -> TransferState:
        """Apply a peer event (accepted, started, progress, done). Events after the end are ignored."""
        if self.state in TERMINAL:
            return self.state
        nxt = _NEXT.get((self.state, event))
        if nxt is None:
            raise InvalidTransition(f"{self.request_id}: {event!r} in state {self.state.value}")
        if nxt == self.state == TransferState.WAITING:  # keepalive: renew the silence limit only
            if self.deadlines.silence_s is not None:
                self.deadline = min(
                    self.waiting_since + self.deadlines.queue_s, now + self.deadlines.silence_s
                )
            return nxt
        if nxt == TransferState.WAITING:
            self.waiting_since = now
        self._enter(nxt, now)
        return nxt

    def fail(self, reason: str, now: float) -> None:
        if self.state not in TERMINAL:
            self.reason = reason
            self._enter(TransferState.FAILED, now)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now > self.deadline

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL
