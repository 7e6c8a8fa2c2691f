"""Batched LoRA ops: `lora_ops(device)` -> lora_shrink, lora_expand and lora_add (shrink then
expand, the one a layer calls), Triton on CUDA, the reference twins elsewhere (or everywhere
with SLIPSTREAM_KERNELS=reference)."""
from __future__ import annotations

from types import SimpleNamespace

from slipstream import envs


def lora_ops(device: str) -> SimpleNamespace:
    forced = envs.KERNELS.get()
    if forced == "triton" or (forced == "auto" and str(device).startswith("cuda")):
        from slipstream.kernels.lora import triton_lora as mod
    else:
        from slipstream.kernels.lora import reference as mod
    return SimpleNamespace(lora_shrink=mod.lora_shrink, lora_expand=mod.lora_expand,
                           lora_add=mod.lora_add)
