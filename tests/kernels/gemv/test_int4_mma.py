"""The tensor-core W4A16 GEMV (kernels/gemv/int4_mma.py): its mma twin against the PTX fragment
layout of mma.m16n8k16, the kernel against the float64 reference (CPU: the interpreter runs
the twin; GPU: the PTX), its fallbacks and its opt-in tuner candidates."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from slipstream.kernels.gemv import int4 as gemv_int4
from slipstream.kernels.gemv import int4_mma as gemv_int4_mma
from slipstream.kernels.gemv import mma_fragments
from slipstream.kernels.gemv.dense import COUNTERS
from slipstream.kernels.gemv.int4 import W4Config
from tests.kernels.gemv.gemv_helpers import check_gate_out, quantized, rel


@triton.jit
def _twin_kernel(a_ptr, b_ptr, c_ptr, d_ptr, NW: tl.constexpr):
    lane = tl.arange(0, 32 * NW)
    d0, d1, d2, d3 = mma_fragments.mma_twin(
        tl.load(a_ptr + 4 * lane), tl.load(a_ptr + 4 * lane + 1), tl.load(a_ptr + 4 * lane + 2),
        tl.load(a_ptr + 4 * lane + 3), tl.load(b_ptr + 2 * lane), tl.load(b_ptr + 2 * lane + 1),
        tl.load(c_ptr + 4 * lane), tl.load(c_ptr + 4 * lane + 1), tl.load(c_ptr + 4 * lane + 2),
        tl.load(c_ptr + 4 * lane + 3), NW)
    tl.store(d_ptr + 4 * lane, d0)
    tl.store(d_ptr + 4 * lane + 1, d1)
    tl.store(d_ptr + 4 * lane + 2, d2)
    tl.store(d_ptr + 4 * lane + 3, d3)


def _pack(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Two 16-bit values as one 32-bit register, the lower-indexed in the low half."""
    bits = lambda v: v.view(torch.int16).to(torch.int32) & 0xFFFF  # noqa: E731
    return bits(lo) | (bits(hi) << 16)


def test_mma_twin_follows_the_ptx_fragment_layout() -> None:
    """PTX ISA, mma.m16n8k16 .bf16: lane (g, t) holds A (g, 2t..2t+1), (g+8, 2t..),
    (g, 2t+8..), (g+8, 2t+8..); B (2t..2t+1, g), (2t+8.., g); C / D (g, 2t..2t+1), (g+8,
    2t..2t+1). The twin on fragments distributed that way equals A B + C for every warp."""
    nw = 2
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(nw, 16, 16, generator=gen).bfloat16()
    b = torch.randn(nw, 16, 8, generator=gen).bfloat16()
    c = torch.randn(nw, 16, 8, generator=gen)
    lane = torch.arange(32 * nw)
    w, g, t = lane // 32, (lane % 32) // 4, lane % 4
    a_regs = torch.stack([_pack(a[w, r, col], a[w, r, col + 1])
                          for r, col in [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                         (g + 8, 2 * t + 8)]], 1)
    b_regs = torch.stack([_pack(b[w, 2 * t, g], b[w, 2 * t + 1, g]),
                          _pack(b[w, 2 * t + 8, g], b[w, 2 * t + 9, g])], 1)
    where = [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]
    c_regs = torch.stack([c[w, r, col] for r, col in where], 1)
    d = torch.empty(32 * nw, 4)
    _twin_kernel[(1,)](a_regs.contiguous(), b_regs.contiguous(), c_regs.contiguous(), d, NW=nw)
    want = a.float() @ b.float() + c
    torch.testing.assert_close(d, torch.stack([want[w, r, col] for r, col in where], 1),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("m,tiles,split,block_k", [(1, 1, 2, 256), (5, 2, 1, 512),
                                                   (11, 2, 2, 256), (2, 1, 1, 512)])
def test_w4_mma_groups_per_step_match_the_reference(m: int, tiles: int, split: int,
                                                    block_k: int) -> None:
    """block_k 256 / 512: two / four groups' words requested per loop step (GROUPS); K of
    eight groups, split-K, a partial last tile: the same results as one group a step."""
    n, k, nw = 45, 1024, 1
    packed = quantized(n, k, 128, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    cfg = W4Config(16 * tiles * nw, block_k, split, nw, 1, mma=True)
    assert gemv_int4_mma.mma_ok(x, 128, block_k)
    assert not gemv_int4_mma.mma_ok(x[:, :640], 128, block_k)  # K not a multiple of block_k
    got = gemv_int4.w4_gemv(x, *packed, 128, None, cfg)
    assert rel(got, gemv_int4.w4_linear_reference(x.double(), *packed, 128)) < 8e-3
    one_group = gemv_int4.w4_gemv(x, *packed, 128, None, W4Config(16 * tiles * nw, 128, split,
                                                                    nw, 1, mma=True))
    assert rel(got, one_group.double()) < 8e-3
    with pytest.raises(ValueError, match="PREFETCH"):
        gemv_int4.w4_gemv(x, *packed, 128, None, W4Config(16 * nw, block_k, 1, nw, 1, True,
                                                          mma=True))
    with pytest.raises(ValueError, match="one group ahead"):
        gemv_int4.w4_gemv(x, *packed, 128, None, W4Config(16 * nw, 128, 1, nw, 1, 2, mma=True))


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("m,tiles,split,prefetch", [(1, 1, 1, False), (3, 2, 3, True),
                                                    (8, 1, 2, True), (12, 2, 1, False),
                                                    (16, 1, 3, True), (16, 2, 3, True)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_w4_mma_kernel_matches_the_reference(m: int, tiles: int, split: int, prefetch: bool,
                                             with_bias: bool) -> None:
    """1-16 rows of bf16 x (above 8 the second mma per A fragment), a partial last tile (N = 45),
    five groups, split-K: each output within bf16 rounding of the float64 reference (A values
    are exact, products exact in float32)."""
    n, k, nw = 45, 640, 1
    packed = quantized(n, k, 128, seed=m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    cfg = W4Config(16 * tiles * nw, 128, split, nw, 1, prefetch, mma=True)
    assert gemv_int4_mma.mma_ok(x, 128)
    got = gemv_int4.w4_gemv(x, *packed, 128, b, cfg)
    want = gemv_int4.w4_linear_reference(x.double(), *packed, 128,
                                         None if b is None else b.double())
    assert got.shape == (m, n) and got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    # bf16 output rounding (the interpreter truncates: up to 2^-8 relative); a wrong fragment,
    # pair or zero correction is off by tens of percent.
    assert rel(got, want) < 8e-3
    for buf in COUNTERS.values():  # split-K tile counters back at zero
        assert int(buf.abs().sum()) == 0


def test_w4_mma_falls_back_where_it_does_not_apply() -> None:
    """Groups of 64, float32 x, or bf16 x that is not 8-byte aligned: the config runs the other
    kernels (float32 or per-word-sum one-row paths, the tensor-core tile kernel), correctly."""
    n, k = 40, 256
    odd = torch.empty(k + 1, dtype=torch.bfloat16)[1:].view(1, k).copy_(torch.randn(1, k))
    for group, x in [(64, torch.randn(1, k).bfloat16()), (128, torch.randn(2, k)),
                     (128, torch.randn(5, k)), (128, odd)]:
        packed = quantized(n, k, group)
        assert not gemv_int4_mma.mma_ok(x, group)
        got = gemv_int4.w4_gemv(x, *packed, group, None, W4Config(64, 128, 0, 4, mma=True))
        want = gemv_int4.w4_linear_reference(x.double(), *packed, group)
        assert rel(got, want) < (8e-3 if x.dtype == torch.bfloat16 else 1e-5)
    with pytest.raises(ValueError, match="rows per warp"):
        gemv_int4.w4_gemv(torch.randn(1, k).bfloat16(), *quantized(n, k, 128), 128, None,
                          W4Config(48, 128, 0, 1, mma=True))


def test_mma_candidates_from_min_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    for m in (2, 4, 8, 16):
        assert any(c.mma for c in gemv_int4.candidate_w4_configs(m, torch.bfloat16))
    assert not any(c.mma for c in gemv_int4.candidate_w4_configs(1, torch.bfloat16))
    monkeypatch.setattr(gemv_int4_mma, "MIN_ROWS", 1)
    assert any(c.mma for c in gemv_int4.candidate_w4_configs(1, torch.bfloat16))
    assert not any(c.mma for c in gemv_int4.candidate_w4_configs(1, torch.float16))
    assert W4Config(64, 128, 0, 4, mma=True).label().startswith("w4 mma n64")
    assert W4Config(64, 128, 0, 4, prefetch=True, mma=True).label().startswith("w4 mma prefetch")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
def test_gpu_w4_mma_kernel(n: int, k: int) -> None:
    """The PTX kernel on the Llama-3.1-8B shapes, 1-16 rows, every candidate tile: within bf16
    rounding of the reference, run twice (split-K counters back at zero)."""
    packed = quantized(n, k, 128, "cuda")
    cfgs = gemv_int4._mma_configs(16, torch.bfloat16)
    for m in (1, 2, 3, 8, 11, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = gemv_int4.w4_linear_reference(x.float(), *packed, 128)
        for cfg in cfgs:
            for _ in range(2):
                got = gemv_int4.w4_gemv(x, *packed, 128, None, cfg)
                assert rel(got, want) < 8e-3, (m, cfg)


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("split,with_bias,prefetch,block_k", [(1, False, False, 128),
                                                              (3, True, True, 128),
                                                              (2, False, False, 256)])
def test_w4_mma_gate_out_equals_product_then_activation(split: int, with_bias: bool,
                                                        prefetch: bool, block_k: int) -> None:
    """One row, a [gate | up] weight (I = 40: the last program's columns partly past I), 32 rows
    a warp: the mma kernel pairs a gate tile with its up tile and writes SiLU(gate)·up, equal to
    silu_and_mul of the same config's stored product (operands rounded to bf16 first)."""

    n, k = 80, 512
    packed = quantized(n, k, 128, seed=5)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    cfg = W4Config(32, block_k, split, 1, 1, prefetch, mma=True)
    assert gemv_int4._mma_gate_out(cfg, x, 128)
    assert not gemv_int4._mma_gate_out(W4Config(16, 128, split, 1, mma=True), x, 128)
    got = gemv_int4.w4_gemv_gate_out(x, *packed, 128, b, cfg)
    check_gate_out(got, gemv_int4.w4_gemv(x, *packed, 128, b, cfg))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_w4_mma_gate_out() -> None:
    """The PTX kernel's gate-out on the Llama-3.1-8B gate/up shape equals silu_and_mul of its
    stored product, with and without split-K."""
    from slipstream.kernels.reference import silu_and_mul

    packed = quantized(28672, 4096, 128, "cuda")
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    for cfg in [W4Config(128, 128, 0, 4, mma=True), W4Config(256, 128, 2, 8, 1, True, mma=True)]:
        got = gemv_int4.w4_gemv_gate_out(x, *packed, 128, None, cfg)
        want = silu_and_mul(gemv_int4.w4_gemv(x, *packed, 128, None, cfg).float())
        torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=1e-2)
