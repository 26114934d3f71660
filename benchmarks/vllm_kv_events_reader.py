"""Runs in vLLM's own venv (benchmarks/vllm_kv_events.py starts it): reads a pdserve worker's KV
events with vLLM's decoder, as a consumer built on vLLM would, and prints what it got as JSON.

    python vllm_kv_events_reader.py EVENTS REPLAY DONE_FILE DROP_AT

Subscribes to EVENTS and decodes every batch with msgspec's decoder for vLLM's KVEventBatch; on a
seq gap asks REPLAY (the ROUTER socket) for the missing batches and decodes those too. After
DROP_AT batches it drops its subscription for a second (the batches published meanwhile are lost
to it) and reconnects: the next batch shows the gap, and the replay fills it. When DONE_FILE
exists and nothing has come for two seconds, it asks for a last replay (batches lost at the tail
show no gap until a later one) and prints the counts. Imports nothing of pdserve.
"""

from __future__ import annotations

import json
import os
import sys
import time

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

END = -1


def main() -> None:
    events_ep, replay_ep, done_file, drop_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context.instance()
    seen: dict[int, str] = {}  # seq -> "live" | "replay"
    counts = {"decoded": 0, "failed": 0, "stored": 0, "removed": 0, "cleared": 0, "token_ids": 0}
    replays = 0
    dropped = False
    last = -1
    topic = b""

    def take(seq: int, payload: bytes, how: str) -> None:
        nonlocal last
        if seq in seen:
            return
        try:
            batch = decoder.decode(payload)
        except msgspec.DecodeError as e:
            counts["failed"] += 1
            print(f"undecodable batch {seq}: {e}", file=sys.stderr)
            return
        counts["decoded"] += 1
        seen[seq] = how
        last = max(last, seq)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                counts["stored"] += 1
                counts["token_ids"] += len(ev.token_ids)
            elif isinstance(ev, BlockRemoved):
                counts["removed"] += 1
            elif isinstance(ev, AllBlocksCleared):
                counts["cleared"] += 1

    def replay(start: int) -> None:
        nonlocal replays
        replays += 1
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(replay_ep)
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        try:
            while sock.poll(10_000):
                _, seq_bytes, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END:
                    return
                take(seq, payload, "replay")
            print("replay timed out", file=sys.stderr)
        finally:
            sock.close()

    def subscribe() -> zmq.Socket:
        s = ctx.socket(zmq.SUB)
        s.setsockopt(zmq.SUBSCRIBE, b"kv@")
        s.connect(events_ep)
        return s

    sub = subscribe()
    print("ready", flush=True)
    idle_since = time.monotonic()
    while True:
        if sub.poll(100):
            topic, seq_bytes, payload = sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > last + 1:
                replay(last + 1)
            take(seq, payload, "live")
            idle_since = time.monotonic()
            if not dropped and len(seen) >= drop_at:
                dropped = True
                sub.close(linger=0)
                time.sleep(1.0)
                sub = subscribe()
        elif os.path.exists(done_file) and time.monotonic() - idle_since > 2.0:
            break
    replay(last + 1)
    top = max(seen) if seen else -1
    gaps = [s for s in range(top + 1) if s not in seen]
    out = {
        "batches": top + 1,
        **counts,
        "gaps": len(gaps),
        "replays": replays,
        "replayed_batches": sum(1 for h in seen.values() if h == "replay"),
        "dropped_subscription": dropped,
        "topic": topic.decode(),
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
