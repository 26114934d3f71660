"""Weight mover: applies a new expert placement at runtime by a double-buffered swap.

Each rank's MoE layers read their slots from an active `LayerPlacement`. `prepare(phy2log)` fills
a standby buffer of the same shape on a background thread while steps keep running on the active
one: a slot whose expert the rank already holds is copied from the active buffer (device to device),
any other from the full expert weights kept in host memory (the "moved" experts; ranks on one
host share that copy), or, where the ranks span hosts and each holds only its own slots, from the
experts the ranks holding them sent (model/ep_fetch.py). `commit()`,
called between two steps, waits for the build and then swaps every layer's placement pointer, so
no step ever sees a half-moved layer. The old buffers become the next standby: two buffers per
layer, allocated once. (Initial slots may be views of the host store: those are never written, the
first move allocates both buffers.)
"""

from __future__ import annotations

import threading

import torch

from pdserve.eplb.placement import LayerPlacement, slot_range
from pdserve.utils.runtime import trim_heap


class ExpertWeightMover:
    def __init__(self, model) -> None:
        """`model`: a MoEModel (its `blocks`, `expert_store`, `rank`, `world`, `arch`, `phy2log`)."""
        self.model = model
        self._standby: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(model.blocks)
        self._thread: threading.Thread | None = None
        self._next: list[LayerPlacement] | None = None
        self._phy2log: torch.Tensor | None = None
        self._error: BaseException | None = None
        self._fetched: dict = {}
        self.moved = 0  # slots of the last prepare copied from host memory

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def prepare(self, phy2log: torch.Tensor, fetched: dict | None = None) -> None:
        """Start building `phy2log` ([moe layers, P], P unchanged) in the standby buffers; `fetched`:
        the experts this rank lacks, by (layer, expert), one slot each (no host copy of them all)."""
        if self._thread is not None:
            raise RuntimeError("a placement is already being prepared")
        phy2log = torch.as_tensor(phy2log, dtype=torch.long).cpu()
        if tuple(phy2log.shape) != tuple(self.model.phy2log.shape):
            raise ValueError(f"placement shape {tuple(phy2log.shape)} != {tuple(self.model.phy2log.shape)}")
        if phy2log.min() < 0 or phy2log.max() >= self.model.arch.num_experts:
            raise ValueError("placement names an expert out of range")
        self._phy2log, self._error, self._next = phy2log.clone(), None, None
        self._fetched = fetched or {}
        self._thread = threading.Thread(target=self._build, name="eplb-mover", daemon=True)
        self._thread.start()

    def ready(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def commit(self) -> int:
        """Wait for the build, then switch every layer to it. Returns the slots moved."""
        if self._thread is None:
            raise RuntimeError("nothing prepared")
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise RuntimeError("building the new expert placement failed") from self._error
        for j, (block, placement) in enumerate(zip(self.model.blocks, self._next)):
            old = block.placement
            block.placement = placement  # the swap: one pointer per layer
            store = self.model.expert_store
            aliases = store is not None and old.gate_up.shares_storage(store[j][0])
            self._standby[j] = None if aliases else (old.gate_up, old.down)
        self.model.phy2log = self._phy2log
        fetched, self._next, self._fetched = self._fetched, None, {}
        if fetched:
            # The experts that came from other ranks (and the exchange's buffers) are freed now: hand
            # that memory back, or the heap keeps a move's worth of it resident (utils/runtime.py).
            del fetched
            trim_heap()
        return self.moved

    def _build(self) -> None:
        try:
            m = self.model
            lo, hi = slot_range(self._phy2log.shape[1], m.rank, m.world)
            moved, built = 0, []
            for j, block in enumerate(m.blocks):
                cur = block.placement
                if self._standby[j] is None:
                    self._standby[j] = (cur.gate_up.empty_like(), cur.down.empty_like())
                gate_up, down = self._standby[j]
                have = {e: s for s, e in enumerate(cur.phy2log[lo:hi].tolist())}
                for s, e in enumerate(self._phy2log[j, lo:hi].tolist()):
                    # A slot in whatever format the experts are packed in (model/experts.py): each of
                    # its tensors copied whole.
                    if e in have:
                        gate_up.copy_slot_(s, cur.gate_up, have[e])
                        down.copy_slot_(s, cur.down, have[e])
                    elif (j, e) in self._fetched:
                        got_gate_up, got_down = self._fetched[(j, e)]
                        gate_up.copy_slot_(s, got_gate_up, 0)
                        down.copy_slot_(s, got_down, 0)
                        moved += 1
                    else:
                        if m.expert_store is None:
                            raise RuntimeError(f"expert {e} of MoE layer {j} was neither held nor fetched")
                        gate_up.copy_slot_(s, m.expert_store[j][0], e)
                        down.copy_slot_(s, m.expert_store[j][1], e)
                        moved += 1
                built.append(
                    LayerPlacement.build(self._phy2log[j], m.arch.num_experts, lo, hi, gate_up, down)
                )
            if gate_up.device.type == "cuda":
                torch.cuda.current_stream(gate_up.device).synchronize()
            self.moved, self._next = moved, built
        except BaseException as exc:  # reported by commit() on the stepping thread
            self._error = exc
