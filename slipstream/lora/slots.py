"""LoRASlots: which adapter holds which device slot, for the scheduler (integers only).

A running request pins its adapter's slot. A request whose adapter is not on the device takes
an empty slot, else the least recently used slot no running request pins; when every slot is
pinned it waits. So an adapter is never replaced under a request that uses it. The runner
copies an adapter's weights into its slot when it first sees the new assignment.
"""
from __future__ import annotations

from collections import OrderedDict


class LoRASlots:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._slot_of: dict[int, int] = {}  # adapter id -> slot
        self._owner: list[int] = [0] * num_slots  # slot -> adapter id (0: empty)
        self._pins: list[int] = [0] * num_slots
        self._unpinned: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))

    def acquire(self, lora_int_id: int) -> int | None:
        """Pin a slot holding the adapter (placing it first if needed); None: all are pinned."""
        slot = self._slot_of.get(lora_int_id)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return None
            old = self._owner[slot]
            if old:
                del self._slot_of[old]
            self._owner[slot] = lora_int_id
            self._slot_of[lora_int_id] = slot
        if self._pins[slot] == 0:
            self._unpinned.pop(slot)
        self._pins[slot] += 1
        return slot

    def _free_slot(self) -> int | None:
        for slot in self._unpinned:  # empty slots first, then the least recently used
            if self._owner[slot] == 0:
                return slot
        return next(iter(self._unpinned), None)

    def release(self, slot: int) -> None:
        if self._pins[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._unpinned[slot] = None  # most recently used: evicted last

    def drop(self, lora_int_id: int) -> None:
        """Forget an adapter's placement when no request pins it (it was unloaded)."""
        slot = self._slot_of.get(lora_int_id)
        if slot is not None and self._pins[slot] == 0:
            del self._slot_of[lora_int_id]
            self._owner[slot] = 0
            self._unpinned.move_to_end(slot, last=False)

    @property
    def num_pinned(self) -> int:
        return sum(1 for p in self._pins if p)

    def holds(self, lora_int_id: int) -> bool:
        return lora_int_id in self._slot_of
