"""The kernel table: one set of fused ops per device, same signatures as kernels/reference.py.

get_ops picks the Triton table (kernels/triton_ops.py) on CUDA and, on the CPU, the reference
twins with a batched paged attention (kernels/cpu.py); envs.KERNELS overrides the choice for
debugging ("reference": the plain twins, the test oracle, everywhere).
"""
from __future__ import annotations

from types import SimpleNamespace

from slipstream import envs
from slipstream.kernels import reference

OP_NAMES = (
    "rms_norm", "fused_add_rms_norm", "silu_and_mul", "apply_rotary", "write_kv_cache",
    "rotary_and_cache_write", "paged_attention",
)


def reference_ops() -> SimpleNamespace:
    return SimpleNamespace(**{name: getattr(reference, name) for name in OP_NAMES}, name="reference")


def get_ops(device: str, use_triton: bool | None = None) -> SimpleNamespace:
    """Reference ops on the CPU; Triton ops on CUDA when available (unless use_triton=False)."""
    if use_triton is None:
        forced = envs.KERNELS.get()  # auto | reference | triton
        use_triton = forced == "triton" or (forced == "auto" and str(device).startswith("cuda"))
    if not use_triton:
        if envs.KERNELS.get() == "auto":
            from slipstream.kernels.cpu import cpu_ops

            return cpu_ops()
        return reference_ops()
    from slipstream.kernels import triton_ops  # imported here: it needs Triton, the CPU path does not

    return triton_ops.ops()
