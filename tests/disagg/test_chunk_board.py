"""The board on which a pipelined chunk's worker waits for the earlier chunks' layers (disagg/pipeline.py)."""

from __future__ import annotations

import threading

from pdserve.disagg.pipeline import ChunkBoard


def test_a_wait_ends_when_the_layer_arrives():
    board = ChunkBoard()
    board.arrived("t", 0)
    assert board.wait("t", 1, 0.0) and board.layers("t") == 1
    threading.Timer(0.05, board.arrived, ("t", 2)).start()
    assert board.wait("t", 3, 30.0)  # layer 2 implies layers 0-2
    assert board.changed.is_set()


def test_a_wait_ends_at_its_deadline_or_on_a_cancel():
    board = ChunkBoard()
    assert not board.wait("t", 1, 0.05)
    threading.Timer(0.05, board.cancel, ("t",)).start()
    assert not board.wait("t", 1, 30.0)  # returns on the cancel, long before the deadline
    board.forget("t")
    board.arrived("t", 0)
    assert board.wait("t", 1, 0.0)


def test_arrivals_for_jobs_never_claimed_are_bounded():
    board = ChunkBoard()
    for i in range(5000):
        board.arrived(f"t{i}", 0)
    assert board.layers("t0") == 0 and board.layers("t4999") == 1
