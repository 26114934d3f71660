"""A job queued at a prefill peer: the decode side gives up on a peer silent for its silence limit
(partitioned, stopped) instead of the whole queue timeout; keepalives (re-sent "accepted") keep a
busy peer's job alive, up to the queue timeout; the prefill side's own clock is unchanged."""

from __future__ import annotations

from pdserve.disagg.state import Deadlines, Transfer, TransferState

DECODE = Deadlines(bootstrap_s=1, queue_s=30, transfer_s=6, silence_s=6)
PREFILL = Deadlines(bootstrap_s=1, queue_s=30, transfer_s=6)


def test_a_silent_peer_is_given_up_after_the_silence_limit():
    t = Transfer("r", DECODE, 0.0)
    assert t.on("accepted", 1.0) == TransferState.WAITING
    assert not t.expired(6.9)
    assert t.expired(7.1)  # 6 s of silence, not 30


def test_keepalives_hold_a_queued_job_until_the_queue_timeout():
    t = Transfer("r", DECODE, 0.0)
    t.on("accepted", 1.0)
    now = 1.0
    while now < 29.0:
        now += 2.0
        assert not t.expired(now)
        assert t.on("accepted", now) == TransferState.WAITING
    assert t.expired(31.1)  # queued since 1.0: the queue timeout still bounds it
    t2 = Transfer("r2", DECODE, 0.0)
    t2.on("accepted", 1.0)
    t2.on("accepted", 3.0)
    assert t2.on("started", 4.0) == TransferState.TRANSFERRING and t2.deadline == 10.0


def test_the_prefill_side_keeps_the_queue_timeout():
    t = Transfer("r", PREFILL, 0.0)
    t.on("accepted", 1.0)
    assert not t.expired(30.9) and t.expired(31.1)
