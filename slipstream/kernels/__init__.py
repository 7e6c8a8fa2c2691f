"""The kernel table: one set of fused ops per device, same signatures as kernels/reference.py."""
from __future__ import annotations

import os
from types import SimpleNamespace

from slipstream.kernels import reference

_OP_NAMES = (
    "rms_norm", "fused_add_rms_norm", "silu_and_mul", "apply_rotary", "write_kv_cache",
    "rotary_and_cache_write", "paged_attention",
)


def reference_ops() -> SimpleNamespace:
    return SimpleNamespace(**{name: getattr(reference, name) for name in _OP_NAMES}, name="reference")


def get_ops(device: str, use_triton: bool | None = None) -> SimpleNamespace:
    """Reference ops on the CPU; Triton ops on CUDA when available (unless use_triton=False)."""
    if use_triton is None:
        forced = os.environ.get("SLIPSTREAM_KERNELS", "auto")  # auto | reference | triton
        use_triton = forced == "triton" or (forced == "auto" and str(device).startswith("cuda"))
    if not use_triton:
        return reference_ops()
    from slipstream.kernels import triton_ops  # imported lazily: needs triton

    return triton_ops.ops()
