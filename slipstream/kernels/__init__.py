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
    "rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "apply_rotary",
    "write_kv_cache",
    "rotary_and_cache_write", "paged_attention",
)


def reference_ops() -> SimpleNamespace:
    return SimpleNamespace(**{name: getattr(reference, name) for name in OP_NAMES}, name="reference")


def get_ops(device: str, use_triton: bool | None = None) -> SimpleNamespace:
    """Triton ops on CUDA; on a CPU the reference twins with the batched attention; the plain
    reference twins where SLIPSTREAM_KERNELS=reference (or use_triton=False off the CPU)."""
    forced = envs.KERNELS.get()  # auto | reference | triton
    on_cuda = str(device).startswith("cuda")
    if use_triton is None:
        use_triton = forced == "triton" or (forced == "auto" and on_cuda)
    if use_triton:
        from slipstream.kernels import triton_ops  # imported here: it needs Triton, the CPU does not

        return triton_ops.ops()
    if forced == "auto" and not on_cuda:
        from slipstream.kernels.cpu import cpu_ops

        return cpu_ops()
    return reference_ops()
