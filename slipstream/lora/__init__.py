"""Multi-LoRA serving: many PEFT adapters over one base model, mixed in one batch.

`request.py` (LoRARequest), `adapter.py` (reading and checking an adapter), `slots.py` (the
scheduler's device-slot pins), `manager.py` (the runner's host cache, slot paging and step
layout), `layers.py` (slot buffers on the linear layers). Kernels: slipstream/kernels/lora/.
"""
from slipstream.lora.request import LoRARequest

__all__ = ["LoRARequest"]
