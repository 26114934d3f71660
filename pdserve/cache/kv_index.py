"""The global KV index a router keeps: block hash -> {worker id: tiers}, fed by KV events.

Pure data, no sockets, so policies and simulators can use it directly.
"""

from __future__ import annotations

from pdserve.protocol import KV_TIERS, KVEvent, KVSnapshot

TIER_RANK = {t: i for i, t in enumerate(KV_TIERS)}  # 0 = fastest


def hash_hex(h: bytes | str) -> str:
    return h.hex() if isinstance(h, bytes) else h


class KVIndex:
    def __init__(self) -> None:
        self._blocks: dict[str, dict[str, set[str]]] = {}  # hash -> worker -> tiers
        self._by_worker: dict[str, set[str]] = {}  # worker -> hashes
        # hash -> {worker: fastest tier rank} for holders WITHOUT a device copy: match() intersects
        # holder sets (C speed) for lengths and consults only this small map for tiers.
        self._slow: dict[str, dict[str, int]] = {}
        self.last_seq: dict[str, int] = {}
        self.needs_snapshot: set[str] = set()  # workers whose events had a gap (or no snapshot yet)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def workers(self) -> list[str]:
        return list(self._by_worker)

    def _add(self, worker: str, h: str, tier: str) -> None:
        self._blocks.setdefault(h, {}).setdefault(worker, set()).add(tier)
        self._by_worker.setdefault(worker, set()).add(h)
        self._resync_slow(worker, h)

    def _resync_slow(self, worker: str, h: str) -> None:
        tiers = self._blocks.get(h, {}).get(worker)
        if tiers and "device" not in tiers:
            self._slow.setdefault(h, {})[worker] = min(TIER_RANK[t] for t in tiers)
            return
        slow = self._slow.get(h)
        if slow is not None:
            slow.pop(worker, None)
            if not slow:
                del self._slow[h]

    def _discard(self, worker: str, h: str, tier: str) -> None:
        holders = self._blocks.get(h)
        tiers = holders.get(worker) if holders else None
        if tiers is None:
            return
        tiers.discard(tier)
        if not tiers:
            del holders[worker]
            self._by_worker[worker].discard(h)
            if not holders:
                del self._blocks[h]
        self._resync_slow(worker, h)

    def apply(self, event: KVEvent) -> bool:
        """False for an event the index already includes (seq at or below the last seen)."""
        worker = event.worker_id
        last = self.last_seq.get(worker)
        if last is not None and event.seq <= last:
            return False
        if last is None or event.seq != last + 1:
            self.needs_snapshot.add(worker)  # missed events: applied anyway, but resync soon
        self.last_seq[worker] = event.seq
        for h in event.block_hashes:
            if event.type == "stored":
                self._add(worker, h, event.tier)
            else:
                self._discard(worker, h, event.tier)
        return True

    def apply_snapshot(self, snap: KVSnapshot) -> None:
        """Replace everything known about snap.worker_id."""
        self.remove_worker(snap.worker_id)
        for h, tiers in snap.blocks.items():
            for tier in tiers:
                self._add(snap.worker_id, h, tier)
        self.last_seq[snap.worker_id] = snap.seq
        self.needs_snapshot.discard(snap.worker_id)

    def remove_worker(self, worker_id: str) -> None:
        for h in self._by_worker.pop(worker_id, set()):
            holders = self._blocks.get(h)
            if holders is not None:
                holders.pop(worker_id, None)
                if not holders:
                    del self._blocks[h]
            self._resync_slow(worker_id, h)
        self.last_seq.pop(worker_id, None)
        self.needs_snapshot.discard(worker_id)

    def worker_blocks(self, worker_id: str) -> dict[str, set[str]]:
        """hash -> tiers, for one worker."""
        return {h: set(self._blocks[h][worker_id]) for h in self._by_worker.get(worker_id, ())}

    def match(self, hashes: list[bytes] | list[str]) -> dict[str, tuple[int, str]]:
        """worker -> (how many leading blocks it holds in some tier, the tier that bounds loading them).

        The tier is the slowest among each block's fastest tier: "device" means the whole matched
        prefix is resident, "disk" means at least one of its blocks must come from disk. Workers
        holding none of the leading blocks are left out. A "remote" block lives in the shared
        store, so any worker could load it; the caller decides whether to count it for others.
        """
        hexes = [hash_hex(x) for x in hashes]
        blocks = self._blocks
        if not hexes or hexes[0] not in blocks:
            return {}
        # Lengths: shrink the set of workers still matching, one set intersection per block.
        alive = set(blocks[hexes[0]])
        length: dict[str, int] = {}
        end = len(hexes)
        for i in range(1, len(hexes)):
            holders = blocks.get(hexes[i])
            nxt = alive.intersection(holders) if holders else set()
            if len(nxt) != len(alive):
                for w in alive - nxt:
                    length[w] = i
                alive = nxt
                if not alive:
                    end = i
                    break
        for w in alive:
            length[w] = len(hexes)
        # Tiers: only blocks some holder lacks on device can make a worker's prefix slower.
        rank: dict[str, int] = {}
        if self._slow:
            for j in range(min(end + 1, len(hexes))):
                slow = self._slow.get(hexes[j])
                if slow:
                    for w, r in slow.items():
                        if length.get(w, 0) > j and r > rank.get(w, 0):
                            rank[w] = r
        return {w: (n, KV_TIERS[rank.get(w, 0)]) for w, n in length.items()}
