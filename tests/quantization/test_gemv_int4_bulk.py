"""The CUDA C++ one-row int4 GEMV (kernels/w4_bulk.cu) and its plain-torch twin.

CPU: the twin's split-int8 numerics (x as a 15-bit fixed point a group of 128) against the
float reference, and the split itself (exact int8 halves). GPU: every variant of the kernel
against the twin and the float reference, eager and replayed in a CUDA graph."""
from __future__ import annotations

import functools

import pytest
import torch

from slipstream.kernels import gemv_int4_bulk
from slipstream.kernels.gemv_int4_bulk import (
    consumer_warps,
    maybe_bulk,
    shared_bytes,
    split_int8_x,
    supported,
    w4_gemv_bulk,
    w4_split_int8_reference,
)
from slipstream.kernels.int4_common import w4_linear_reference
from tests.quantization.gemv_helpers import (
    fused_variant,
    quantized,
    rel,
    replayed_in_a_graph,
    rms_normed,
)


def test_split_int8_halves_are_exact_bytes() -> None:
    x = torch.randn(1, 1024) * torch.logspace(-3, 3, 1024)  # groups of very different ranges
    x[0, 128:256] = 0.0  # an all-zero group: step 1, every xq 0
    xq, step = split_int8_x(x.bfloat16())
    hi = (xq + 128) >> 8
    lo = xq - hi * 256
    assert int(hi.min()) >= -128 and int(hi.max()) <= 127
    assert int(lo.min()) >= -128 and int(lo.max()) <= 127
    assert int(xq.abs().max()) <= 127 * 256
    assert float(step[0, 1]) == 1.0 and int(xq[0, 128:256].abs().max()) == 0
    # each group's largest |x| maps to 32512 and the rest within half a step
    back = (xq.float().unflatten(-1, (-1, 128)) * step[..., None]).flatten(-2)
    err = (back - x.bfloat16().float()).abs().unflatten(-1, (-1, 128)).amax(-1)
    assert bool((err <= 0.5001 * step).all())


@pytest.mark.parametrize("n,k", [(64, 1024), (48, 4096)])
def test_split_int8_twin_matches_the_float_reference(n, k) -> None:
    q, s, z = quantized(n, k, 128, seed=k)
    x = torch.randn(1, k).bfloat16()
    want = w4_linear_reference(x, q, s, z, 128)
    got = w4_split_int8_reference(x, q, s, z)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # bf16 output rounding (~2^-9) dominates; x's fixed point adds ~1e-5
    assert rel(got, want) < 4e-3


def test_supported_shapes() -> None:
    assert supported(4096, 4096, 8, 128)
    assert not supported(4096, 4096, 8, 64)   # groups of 128 only
    assert not supported(4100, 4096, 8, 128)  # 16-row tiles
    assert not supported(4096, 3072, 16, 128)  # K over 16 warps: multiples of 2048
    assert supported(28672, 4096, 8, 128, gate_out=True) and not supported(40, 4096, 8, 128,
                                                                               gate_out=True)
    # x of at most 4 groups a warp: Llama-3.1-8B's down projection (K 14336) stays on Triton
    assert consumer_warps(4096) == 8 and consumer_warps(8192) == 16
    assert consumer_warps(14336) is None and consumer_warps(1000) is None
    # the ring fits the H200's 227 KiB of shared memory a block at the default stages
    assert shared_bytes(4096, 16, gemv_int4_bulk.STAGES) <= 227 * 1024


def test_maybe_bulk_stays_off_unless_asked(monkeypatch) -> None:
    q, s, z = quantized(64, 1024, 128)
    x = torch.randn(1, 1024).bfloat16()
    assert maybe_bulk(x, q, s, z, 128, None) is None  # off by default
    monkeypatch.setattr(gemv_int4_bulk, "ENABLED", True)
    assert maybe_bulk(x, q, s, z, 128, None) is None  # CUDA only: the caller's path runs


@pytest.mark.gpu
@pytest.mark.parametrize("xq", [0, 2])
@pytest.mark.parametrize("n,k,cwarps,stages", [
    (4096, 4096, 8, 6), (6144, 4096, 16, 4), (28672, 4096, 8, 5), (4096, 2048, 4, 3),
])
def test_bulk_gemv_matches_the_reference(n, k, cwarps, stages, xq) -> None:
    q, s, z = quantized(n, k, 128, device="cuda", seed=n + k)
    x = torch.randn(1, k, device="cuda").bfloat16()
    got = w4_gemv_bulk(x, q, s, z, cwarps=cwarps, stages=stages, xq=xq)
    want = w4_linear_reference(x, q, s, z, 128)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert rel(got, want) < 4e-3
    if xq:
        assert rel(got, w4_split_int8_reference(x, q, s, z)) < 4e-3


@pytest.mark.gpu
def test_bulk_gemv_in_a_cuda_graph() -> None:
    out, want = replayed_in_a_graph(w4_gemv_bulk, 4096, 4096)
    assert rel(out, want) < 4e-3



@pytest.mark.gpu
@pytest.mark.parametrize("xq", [0, 2])
@pytest.mark.parametrize("bias,rms_eps,gate_out", [
    (True, 0.0, False), (False, 1e-5, False), (False, 0.0, True), (True, 1e-5, True),
])
def test_bulk_gemv_fused_variants(bias, rms_eps, gate_out, xq) -> None:
    got, want = fused_variant(functools.partial(w4_gemv_bulk, xq=xq), bias, rms_eps, gate_out)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert rel(got, want) < 6e-3


@pytest.mark.gpu
def test_maybe_bulk_serves_the_one_row_calls(monkeypatch) -> None:
    from slipstream.kernels import gemv_int4, gemv_int4_stream

    monkeypatch.setattr(gemv_int4_stream, "ENABLED", False)  # it would serve these calls first
    monkeypatch.setattr(gemv_int4_bulk, "ENABLED", True)
    q, s, z = quantized(1024, 4096, 128, device="cuda", seed=5)
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    want = w4_linear_reference(x, q, s, z, 128)
    assert rel(gemv_int4.w4_linear_small(x, q, s, z, 128), want) < 4e-3
    got = gemv_int4.w4_linear_small_rms(x, q, s, z, 128, None, 1e-5)
    assert rel(got, w4_linear_reference(rms_normed(x, 1e-5), q, s, z, 128)) < 4e-3
    assert gemv_int4.w4_linear_small_gate_out(x, q, s, z, 128).shape == (1, 512)
    # down-projection shapes (K 14336) and two rows keep the Triton path
    assert maybe_bulk(torch.randn(1, 14336, device="cuda").bfloat16(), *quantized(
        64, 14336, 128, device="cuda"), 128, None) is None
    assert maybe_bulk(torch.randn(2, 4096, device="cuda").bfloat16(), q, s, z, 128, None) is None


def test_driver_launch_structs_match_cuda_h() -> None:
    """cuLaunchKernelEx's CUlaunchConfig and CUlaunchAttribute as cuda.h lays them out (64-bit)."""
    import ctypes

    from slipstream.kernels.cuda_launch import _LaunchAttribute, _LaunchConfig

    assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_LaunchConfig) == 56
    assert (_LaunchConfig.shared_mem.offset, _LaunchConfig.stream.offset,
            _LaunchConfig.attrs.offset, _LaunchConfig.num_attrs.offset) == (24, 32, 40, 48)
