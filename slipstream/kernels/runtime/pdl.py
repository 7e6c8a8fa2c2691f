"""Programmatic dependent launch (PDL, Hopper and newer): a kernel starts while the one before it
in the stream is still finishing, and waits on the device only where it reads that kernel's output.

A decode step is ~300 small kernels; without PDL each one pays a launch gap and a cold start
(the first weight loads in flight only after the previous kernel has fully drained). With it,
a GEMV issues its first weight loads (never written by anyone) before `pdl_wait`, and every other
kernel waits at its top. Rules for a kernel launched with `launch_kwargs(...)`:
- read nothing an earlier kernel writes, and write nothing, before `pdl_wait(USE_PDL)`;
- reach `pdl_wait` on every path, early returns included: the wait covers only the previous
  kernel, and it is that kernel's own wait that covers the ones before it;
- call `pdl_release(USE_PDL)` to let the next kernel launch (optional; it only starts it earlier).
Used only under CUDA-graph capture (see launch_kwargs); envs.PDL (SLIPSTREAM_PDL=0) turns it off.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from slipstream import envs

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAVE_GDC = True
except ImportError:  # an older Triton: PDL stays off and these are never compiled
    _HAVE_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Block until the previous kernel in the stream has completed and its writes are visible."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def pdl_release(USE_PDL: tl.constexpr):
    """Allow the next kernel in the stream to launch now (it still waits at its pdl_wait)."""
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def _globaltimer(dummy):
    """The GPU's nanosecond timer (PTX %globaltimer; dummy only gives the asm an operand)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dummy],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _spin_kernel(ns, USE_PDL: tl.constexpr = False):
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
    t0 = _globaltimer(ns)
    t = t0
    while t - t0 < ns:
        t = _globaltimer(ns)


def spin(device: torch.device, us: float) -> None:
    """One program that waits for the kernel before it, then spins for `us` microseconds while
    letting the next kernel launch: a stand-in for a latency-bound kernel such as decode
    attention, under which a GEMV may already request its weights (kernels/runtime/tuning.py)."""
    _spin_kernel[(1,)](int(us * 1000), num_warps=1, **launch_kwargs(device))


def _triton_has_launch_pdl() -> bool:
    try:  # imported here: the NVIDIA backend module is absent from some Triton builds
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@functools.cache
def _device_supports(index: int) -> bool:
    return (_HAVE_GDC and _triton_has_launch_pdl()
            and torch.cuda.get_device_capability(index) >= (9, 0))


def enabled(device: torch.device) -> bool:
    """Whether kernels on this device launch with PDL (CUDA, compute capability 9.0+, a Triton
    that supports it, and envs.PDL not turned off)."""
    if device.type != "cuda" or not envs.PDL.get():
        return False
    return _device_supports(device.index if device.index is not None
                            else torch.cuda.current_device())


def launch_kwargs(device: torch.device) -> dict:
    """Extra launch arguments for a kernel that takes USE_PDL: PDL on while a CUDA graph is being
    captured (the decode steps and the tuner's timing), else nothing. Eager steps go without:
    a prefill ran over twice as long with PDL launches."""
    # Capture first: eager launches (most of them) then skip the environment read.
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing() and enabled(device):
        return _ON
    return _OFF


_ON = {"USE_PDL": True, "launch_pdl": True}
_OFF: dict = {}
