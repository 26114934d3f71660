"""The wire forms of pdserve/protocol: what one side encodes the other side decodes to the same value,
and the bytes keep the shape peers already speak."""

from __future__ import annotations

import json

import pytest

from pdserve.protocol.health import WorkerHealth
from pdserve.protocol.stream import TokenLine


def test_a_token_line_round_trips_and_names_prefill_workers_only_when_asked():
    plain = TokenLine([5, 6], None, False, None, 3)
    assert json.loads(plain.encode()) == {
        "token_ids": [5, 6],
        "logprobs": None,
        "finished": False,
        "finish_reason": None,
        "num_prompt_tokens": 3,
    }
    first = TokenLine([7], [[7, -0.5, 1, [[7, -0.5]]]], True, "length", 3, "tcp://p:1", ["tcp://q:2"])
    assert TokenLine.from_wire(json.loads(first.encode())) == first
    assert TokenLine.from_wire(json.loads(plain.encode())) == plain
    with pytest.raises(KeyError):
        TokenLine.from_wire({"token_ids": [1]})


def test_a_health_body_keeps_unknown_stats_and_defaults_what_it_lacks():
    h = WorkerHealth.from_wire({"status": "ok", "worker_id": "w", "kv_blocks_free": 3, "tier_loading": 2})
    assert (h.worker_id, h.kv_blocks_free, h.kv_blocks_total, h.pid) == ("w", 3, 0, None)
    assert h.stat("tier_loading") == 2.0 and h.stat("nothing") == 0.0
    assert h.to_wire()["tier_loading"] == 2
    with pytest.raises(ValueError):
        WorkerHealth.from_wire({"kv_blocks_free": "many"})
    with pytest.raises(ValueError):
        WorkerHealth.from_wire([1, 2])


def test_every_pd_message_round_trips_through_msgpack_as_its_type():
    from pdserve.protocol import PD_LAYER, PD_TOO_LONG, pack, unpack
    from pdserve.protocol.pd import (
        Accepted,
        Cancel,
        CancelAck,
        Done,
        Failed,
        LayerFrames,
        LayerWritten,
        Started,
        decode_pd,
    )

    for msg in (
        Cancel("r", "t", "tcp://d:1"),
        Accepted("r", "t", 12, "h"),
        Started("r", "t"),
        LayerWritten("r", "t", 3),
        LayerFrames("r", "t", 2, [[4, 2]]),
        Done("r", "t", 7, [7, -0.1, 1, []], 64, 0.5),
        Done("r", "t", 7, None, 64, 0.5, [None, [3, -0.2, 1, [[3, -0.2]]]]),
        Failed("r", "t", "too long", PD_TOO_LONG),
        CancelAck("r", "t"),
    ):
        assert decode_pd(unpack(pack(msg.to_wire()))) == msg
    frames = LayerFrames("r", "t", 0, [[1, 1]], received_bytes=99)
    assert "received_bytes" not in frames.to_wire()  # counted on arrival, never sent
    assert decode_pd(
        {"type": PD_LAYER, "request_id": "r", "transfer_id": "t", "upto_block": 2}
    ) == LayerWritten("r", "t", 2)
    for bad in (
        {"type": "done", "request_id": "r", "transfer_id": "t"},  # no token
        {"type": "done", "request_id": ["r"], "transfer_id": "t", "token": 1},
        {"type": "prefill", "request_id": "r", "transfer_id": "t"},
        {"type": "nonsense", "request_id": "r", "transfer_id": "t"},
    ):
        with pytest.raises(ValueError):
            decode_pd(bad)
