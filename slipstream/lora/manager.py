"""LoRAManager: the runner's side of multi-LoRA. Adapters read on the host (an LRU of up to
max_cpu_loras), paged into the device slots the scheduler assigns (lora/slots.py), and the
per-step layout the LoRA layers read (lora/layers.py, kernels/lora/meta.py).

The scheduler never reassigns a slot that a running request pins, so a slot's weights change
only between the steps that use it; the copy is queued on the stream behind any step still in
flight. A step in which no request uses an adapter turns LoRA off: the model runs exactly as
an engine without LoRA.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from slipstream.config import EngineConfig
from slipstream.dtypes import resolve_dtype
from slipstream.kernels.lora.meta import meta_views, pack_meta
from slipstream.lora.adapter import LoRAAdapter, load_adapter
from slipstream.lora.layers import attach_lora
from slipstream.scheduler.output import ScheduledSeq

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device):
        cfg = config.lora
        self.config = config
        self.device = device
        self.dtype = resolve_dtype(config.dtype)
        self.num_slots = cfg.max_loras
        self.state, self.layers = attach_lora(model, cfg.max_loras, cfg.max_lora_rank,
                                              config.scheduler.max_num_seqs, self.dtype, device)
        self._paths: dict[int, str] = {}  # every adapter id seen -> its directory
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._slot_owner = [0] * cfg.max_loras  # adapter id whose weights each slot holds
        self.num_slot_loads = 0
        self.force_slot: int | None = None  # warm-up: every token on this slot
        self._staged: bytes | None = None  # the token slots whose layout the static buffer holds
        nbytes = sum(lo.a.nbytes + lo.b.nbytes for lo in self.layers.values())
        logger.info("LoRA: %d slots of rank %d, %.1f MiB on %s", cfg.max_loras,
                    cfg.max_lora_rank, nbytes / 2**20, device)

    # ---- adapters on the host ------------------------------------------------------------
    def add(self, lora_int_id: int, path: str | None) -> None:
        """Register (and read, checking it) an adapter; ValueError names what is wrong."""
        if path is None:
            raise ValueError(f"LoRA adapter {lora_int_id} has no path")
        known = self._paths.get(lora_int_id)
        if known is not None and known != path:
            raise ValueError(f"lora_int_id {lora_int_id} already names the adapter at {known}; "
                             f"give {path} another id")
        self._adapter(lora_int_id, path)
        self._paths[lora_int_id] = path

    def _adapter(self, lora_int_id: int, path: str) -> LoRAAdapter:
        adapter = self._host.get(lora_int_id)
        if adapter is not None:
            self._host.move_to_end(lora_int_id)
            return adapter
        lora = self.config.lora
        adapter = load_adapter(lora_int_id, path, self.config.model, lora.max_lora_rank,
                               self.dtype, pin=self.device.type == "cuda")
        self._host[lora_int_id] = adapter
        while len(self._host) > lora.max_cpu_loras:
            self._host.popitem(last=False)  # read again from disk if it comes back
        return adapter

    # ---- adapters in device slots --------------------------------------------------------
    def _ensure_slot(self, slot: int, lora_int_id: int) -> None:
        if self._slot_owner[slot] == lora_int_id:
            return
        adapter = self._adapter(lora_int_id, self._paths[lora_int_id])
        for key, layer in self.layers.items():
            image = adapter.images.get(key)
            if image is None:
                layer.clear(slot)
            else:
                layer.load(slot, image)
        self._slot_owner[slot] = lora_int_id
        self.num_slot_loads += 1

    def _row_slots(self, seqs: Sequence[ScheduledSeq]) -> list[int]:
        """Each seq's slot (-1: base model), its adapter's weights paged in (checked once per
        slot, not per seq: this runs on the host before every LoRA step)."""
        if self.force_slot is not None:
            return [self.force_slot] * len(seqs)
        slots, owners = [], {}
        for seq in seqs:
            request = seq.request
            if request.lora_int_id:
                if request.lora_slot < 0:
                    raise RuntimeError(f"request {request.request_id} runs without a LoRA slot")
                owners[request.lora_slot] = request.lora_int_id
                slots.append(request.lora_slot)
            else:
                slots.append(-1)
        for slot, lora_int_id in owners.items():
            self._ensure_slot(slot, lora_int_id)
        return slots

    def uses_adapters(self, seqs: Sequence[ScheduledSeq]) -> bool:
        return self.force_slot is not None or any(s.request.lora_int_id for s in seqs)

    # ---- the step's layout ---------------------------------------------------------------
    def prepare_eager(self, seqs: Sequence[ScheduledSeq]) -> bool:
        """The layout of a flat batch of `seqs` (each its num_tokens rows); False (LoRA off)
        when none uses an adapter."""
        if not self.uses_adapters(seqs):
            self.state.set_off()
            return False
        counts = [s.num_tokens for s in seqs]
        token_slots = np.repeat(np.array(self._row_slots(seqs), dtype=np.int32), counts)
        packed = self._to_device(pack_meta(token_slots, self.num_slots))
        self.state.set_eager(meta_views(packed, len(token_slots), self.num_slots))
        return True

    def stage_static(self, seqs: Sequence[ScheduledSeq], padded: int) -> bool:
        """The layout of a decode batch of `seqs` (one row each) padded to `padded` rows, into
        the static buffer the LoRA decode graphs read; False (LoRA off) when none uses one."""
        if not self.uses_adapters(seqs):
            self.state.set_off()
            return False
        slots = np.full(padded, -1, dtype=np.int32)
        slots[: len(seqs)] = self._row_slots(seqs)
        key = slots.tobytes()
        if key != self._staged:  # a steady decode batch keeps its layout: no host work, no copy
            packed = pack_meta(slots, self.num_slots)
            self.state.static[: len(packed)].copy_(self._to_device(packed, pinned_only=True),
                                                   non_blocking=True)
            self._staged = key
        self.state.mode = "static"
        return True

    def _to_device(self, array: np.ndarray, pinned_only: bool = False) -> torch.Tensor:
        """The array on the device (pinned_only: in pinned host memory, for the caller to copy
        straight into a device buffer)."""
        t = torch.from_numpy(array)
        if self.device.type != "cuda":
            return t
        t = t.pin_memory()
        return t if pinned_only else t.to(self.device, non_blocking=True)

    def capture(self, make_graphs: Callable[[], object]) -> object:
        """Decode graphs captured with LoRA on (static layout, every tile empty until staged)."""
        self.state.static.fill_(-1)
        self._staged = None
        self.state.mode = "static"
        try:
            graphs = make_graphs()
        finally:
            self.state.set_off()
        return graphs

    def off(self) -> None:
        self.state.set_off()

    def get_stats(self) -> dict:
        return {"lora_adapters_on_host": len(self._host), "lora_slot_loads": self.num_slot_loads}
