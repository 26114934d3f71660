"""Two micro-batches per expert-parallel step, so that one's exchange is in flight while the other
computes (model.ep_overlap; SGLang's two-batch overlap, on the ranks of this design).

With data-parallel attention a rank's share of a step splits again into two micro-batches (the same
LPT split, dp_attention.py), each run through the whole model in a thread of its own. Only one of
the two computes at a time: they pass a baton. A micro-batch that has started an all-to-all
(ep_exchange.py) hands the baton over and reads its answer only once it holds the baton again, so
while its rows travel, or while the ranks holding its experts still compute, the other micro-batch
runs its attention or its experts.

Every rank alternates the same way: lane 0's k-th message is started before lane 1's k-th, and lane
1's k-th before lane 0's (k+1)-th. So each lane's collectives meet in the same order on every rank
(and one gloo group's collectives too), and a rank waiting for a peer's message of one lane never
waits on something that peer can only do after it: no deadlock. A micro-batch without tokens still
takes part in every exchange (MoEModel.idle_step).

The cost: each micro-batch reads the rank's experts once, so a step reads them twice. It pays where
the waits it hides outweigh that, i.e. with many tokens per expert or slow links.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


class OtherLaneFailed(RuntimeError):
    """The other micro-batch of the step raised (a peer lost); this one stops at its next exchange."""


class Baton:
    """Two lanes (micro-batches) on one core: only the holder runs."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._holder = 0
        self._done = [False, False]
        self._failed = False
        self._local = threading.local()

    def lane(self) -> int | None:
        """The calling thread's lane, or None outside `run`."""
        return getattr(self._local, "lane", None)

    def pass_(self) -> None:
        """The holder, with a message in flight, lets the other lane run until that one passes back or
        ends (the holder keeps running when the other has ended)."""
        me = self._local.lane
        with self._cv:
            if not self._done[1 - me]:
                self._holder = 1 - me
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._holder == me)
            if self._failed:
                raise OtherLaneFailed("the step's other micro-batch failed")

    def run(self, first: Callable[[], T], second: Callable[[], T]) -> tuple[T, T]:
        """first() on lane 0 (this thread, which starts with the baton) and second() on lane 1; both
        results, or the first error raised (after both lanes have stopped)."""
        with self._cv:
            self._holder, self._done, self._failed = 0, [False, False], False
        results: list = [None, None]
        errors: list[BaseException | None] = [None, None]

        def body(lane: int, fn: Callable[[], T]) -> None:
            self._local.lane = lane
            try:
                with self._cv:
                    self._cv.wait_for(lambda: self._holder == lane)
                    if self._failed:
                        raise OtherLaneFailed("the step's other micro-batch failed")
                results[lane] = fn()
            except BaseException as exc:
                errors[lane] = exc
            finally:
                self._local.lane = None
                with self._cv:
                    self._done[lane] = True
                    self._failed = self._failed or errors[lane] is not None
                    self._holder = 1 - lane
                    self._cv.notify_all()

        t = threading.Thread(target=body, args=(1, second), name="pdserve-ep-lane1", daemon=True)
        t.start()
        body(0, first)
        t.join()
        for e in errors:  # the cause, not the other lane's OtherLaneFailed
            if e is not None and not isinstance(e, OtherLaneFailed):
                raise e
        for e in errors:
            if e is not None:
                raise e
        return results[0], results[1]
