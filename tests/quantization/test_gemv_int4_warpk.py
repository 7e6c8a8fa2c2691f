"""The warp-K tensor-core W4A16 GEMV (kernels/gemv_int4_warpk.py): against the float64 reference
(CPU: the interpreter runs the mma and x-pair twins; GPU: the PTX) plain, split-K, gate-out and
with the in-kernel RMSNorm; its applicability checks and its tuner candidates."""
from __future__ import annotations

import pytest
import torch

from slipstream.kernels import gemv_int4, gemv_int4_warpk
from slipstream.kernels.gemv import _COUNTERS
from slipstream.kernels.gemv_int4 import W4Config
from slipstream.kernels.reference import silu_and_mul
from tests.quantization.gemv_helpers import check_gate_out, quantized, rel


def _normed(x: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("m,tiles,nw,split", [(1, 1, 1, 1), (1, 2, 2, 1), (1, 1, 2, 2),
                                              (3, 2, 1, 4), (8, 1, 2, 4), (1, 2, 1, 8)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_warpk_matches_the_reference(m: int, tiles: int, nw: int, split: int,
                                     with_bias: bool) -> None:
    """1-8 rows of bf16 x, a partial last tile (N = 45), K of eight groups split over programs
    and warps into 1-8 groups each: within bf16 output rounding of the float64 reference (A
    values exact, products exact in float32); the split-K counters back at zero."""
    n, k = 45, 1024
    packed = quantized(n, k, 128, seed=m + split)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    cfg = W4Config(16 * tiles, 128, split, nw, warp_k=True)
    got = gemv_int4.w4_gemv(x, *packed, 128, b, cfg)
    want = gemv_int4.w4_linear_reference(x.double(), *packed, 128,
                                         None if b is None else b.double())
    assert got.shape == (m, n) and got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    # bf16 output rounding (the interpreter truncates: up to 2^-8 relative); a wrong fragment,
    # word order, group or zero correction is off by tens of percent.
    assert rel(got, want) < 8e-3
    for buf in _COUNTERS.values():
        assert int(buf.abs().sum()) == 0


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("nw,split", [(1, 1), (2, 2)])
def test_warpk_gate_out_and_rms(nw: int, split: int) -> None:
    """Two tiles as gate and up rows: SiLU(gate)·up of the same config's product; with rms_eps
    the product of x / rms(x), plain and gate-out."""
    n, k = 64, 1024
    packed = quantized(n, k, 128, seed=4)
    gen = torch.Generator().manual_seed(9)
    x, b = (5.0 * torch.randn(1, k, generator=gen)).bfloat16(), torch.randn(n, generator=gen)
    cfg = W4Config(32, 128, split, nw, warp_k=True)
    product = gemv_int4.w4_gemv(x, *packed, 128, b.bfloat16(), cfg)
    check_gate_out(gemv_int4.w4_gemv_gate_out(x, *packed, 128, b.bfloat16(), cfg), product)
    want = gemv_int4.w4_linear_reference(_normed(x, 1e-6), *packed, 128, b.double())
    got = gemv_int4.w4_gemv(x, *packed, 128, b.bfloat16(), cfg, rms_eps=1e-6)
    assert rel(got, want) < 8e-3
    got = gemv_int4.w4_gemv_gate_out(x, *packed, 128, b.bfloat16(), cfg, rms_eps=1e-6)
    assert rel(got, silu_and_mul(want.bfloat16().double())) < 1.6e-2


def test_warpk_refuses_what_it_cannot_run() -> None:
    """A K that does not split into 1, 2, 4 or 8 groups per warp, groups other than 128, more
    than 8 rows, float32 x, one tile for gate-out: clear errors (the tuner skips them)."""
    packed = quantized(16, 1024, 128)
    x = torch.randn(1, 1024).bfloat16()
    assert gemv_int4_warpk.groups_per_warp(1024, 1, 2) == 4
    assert gemv_int4_warpk.groups_per_warp(1024, 1, 16) == 0  # half a group a warp
    assert gemv_int4_warpk.groups_per_warp(14336, 7, 8) == 2
    assert gemv_int4_warpk.groups_per_warp(14336, 1, 8) == 0  # 14 groups a warp
    with pytest.raises(ValueError, match="warp-K"):
        gemv_int4.w4_gemv(x, *packed, 128, None, W4Config(16, 128, 3, 1, warp_k=True))
    with pytest.raises(ValueError, match="warp-K"):
        gemv_int4.w4_gemv(x.float(), *packed, 128, None, W4Config(16, 128, 1, 1, warp_k=True))
    with pytest.raises(ValueError, match="warp-K"):
        gemv_int4.w4_gemv(x.expand(9, 1024), *packed, 128, None,
                          W4Config(16, 128, 1, 1, warp_k=True))
    with pytest.raises(ValueError, match="warp-K"):
        gemv_int4.w4_gemv(x, *quantized(16, 1024, 64), 64, None,
                          W4Config(16, 128, 1, 1, warp_k=True))
    with pytest.raises(ValueError, match="two tiles"):
        gemv_int4.w4_gemv_gate_out(x, *packed, 128, None, W4Config(16, 128, 1, 1, warp_k=True))


def test_warpk_candidates_at_one_bf16_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner offers warp-K tiles for one row of bf16 x only, with 16 or 32 rows a program,
    and not when SLIPSTREAM_W4_WARPK=0 has left them out."""
    warpk = [c for c in gemv_int4.candidate_w4_configs(1, torch.bfloat16) if c.warp_k]
    assert warpk and all(c.block_n in (16, 32) and c.split_k >= 1 for c in warpk)
    assert "mma warp-K" in warpk[0].label()
    assert not any(c.warp_k for c in gemv_int4.candidate_w4_configs(1, torch.float32))
    assert not any(c.warp_k for c in gemv_int4.candidate_w4_configs(4, torch.bfloat16))
    monkeypatch.setattr(gemv_int4, "WARPK_CANDIDATES", False)
    assert not any(c.warp_k for c in gemv_int4.candidate_w4_configs(1, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096), (4096, 14336)])
def test_gpu_warpk_every_candidate(n: int, k: int) -> None:
    """Every warp-K candidate that applies to the Llama-3.1-8B shape, on the GPU, twice: plain,
    with rms_eps and (two tiles) gate-out, against the reference."""
    packed = quantized(n, k, 128, "cuda")
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    want = gemv_int4.w4_linear_reference(x.double(), *packed, 128)
    normed = gemv_int4.w4_linear_reference(_normed(x, 1e-5), *packed, 128)
    tried = 0
    for cfg in gemv_int4.candidate_w4_configs(1, torch.bfloat16):
        if not cfg.warp_k or not gemv_int4_warpk.groups_per_warp(k, cfg.split_k, cfg.num_warps):
            continue
        tried += 1
        for _ in range(2):
            assert rel(gemv_int4.w4_gemv(x, *packed, 128, None, cfg), want) < 8e-3, cfg.label()
        got = gemv_int4.w4_gemv(x, *packed, 128, None, cfg, rms_eps=1e-5)
        assert rel(got, normed) < 8e-3, cfg.label() + " rms"
        if cfg.block_n == 32:
            got = gemv_int4.w4_gemv_gate_out(x, *packed, 128, None, cfg)
            assert rel(got, silu_and_mul(want.bfloat16().double())) < 1.6e-2, cfg.label()
    assert tried >= 3
