"""The INT8 / FP8 tensor-core GEMV (kernels/gemv_w8_mma.py) through qgemv: against the float64
reference (CPU: the interpreter runs the conversion and mma twins; GPU: the PTX), its
fallbacks and its opt-in tuner candidates."""
from __future__ import annotations

import pytest
import torch

from slipstream.kernels import gemv_int8, gemv_w8_mma
from slipstream.kernels.gemv import _COUNTERS, GemvConfig
from slipstream.quantization import utils
from tests.quantization.gemv_helpers import check_gate_out, rel


def _w8(n: int, k: int, device: str = "cpu", seed: int = 0, dtype=torch.float8_e4m3fn):
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(n, k, generator=g, device=device)
    if dtype == torch.int8:
        return utils.quantize_int8_per_channel(w)
    return utils.quantize_fp8_per_channel(w)


def _fp8(n: int, k: int, device: str = "cpu", seed: int = 0):
    return _w8(n, k, device, seed)


def _want(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None):
    return gemv_int8.qgemv_reference(x.double(), q, s, None if b is None else b.double())


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("m,tiles,split,prefetch", [(1, 1, 1, False), (3, 2, 3, True),
                                                    (8, 1, 2, True), (12, 2, 1, False),
                                                    (16, 2, 3, True)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_w8_mma_kernel_matches_the_reference(m: int, tiles: int, split: int, prefetch: bool,
                                             with_bias: bool, dtype: torch.dtype) -> None:
    """1-16 rows of bf16 x (above 8 the second mma per A fragment), a partial last tile (N = 45),
    five 64-wide chunks, split-K, FP8 and INT8 weights: within bf16 output rounding of the
    float64 reference (the byte -> float16 conversions are exact, x / 16 in float16 exact at
    these magnitudes; INT8's offset of 1152 cancels in float32)."""
    n, k, nw = 45, 320, 1
    q, s = _w8(n, k, seed=m, dtype=dtype)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    cfg = GemvConfig(16 * tiles * nw, gemv_w8_mma.CHUNK, split, nw, 1, prefetch, mma=True)
    assert gemv_w8_mma.mma_ok(x, q)
    got = gemv_int8.qgemv(x, q, s, b, cfg)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    # bf16 output rounding (the interpreter truncates: up to 2^-8 relative); a wrong fragment,
    # byte order or scale is off by tens of percent.
    assert rel(got, _want(x, q, s, b)) < 8e-3
    for buf in _COUNTERS.values():  # split-K tile counters back at zero
        assert int(buf.abs().sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_w8_mma_x_range(dtype: torch.dtype) -> None:
    """x / 16 in float16: activations of 3e4 (near float16's 65504 as they are, well inside it
    divided) and of 1e-4 (float16 subnormals after the division) stay within bf16 rounding."""
    n, k = 32, 128
    q, s = _w8(n, k, dtype=dtype)
    x = torch.randn(2, k)
    x[0, ::3] *= 3e4
    x[1] *= 1e-4
    x = x.bfloat16()
    got = gemv_int8.qgemv(x, q, s, None, GemvConfig(32, 64, 1, 1, mma=True))
    for r in range(2):
        assert rel(got[r], _want(x[r:r + 1], q, s, None)[0]) < 8e-3


def test_w8_mma_falls_back_where_it_does_not_apply() -> None:
    """float32 x, x that is not 8-byte aligned, K not a multiple of 64, or a gated call: the
    config runs the dequant kernels, correctly."""
    n, k = 40, 256
    cfg = GemvConfig(32, 64, 0, 1, mma=True)
    odd = torch.empty(k + 1, dtype=torch.bfloat16)[1:].view(1, k).copy_(torch.randn(1, k))
    for x, (q, s) in [(torch.randn(2, k), _fp8(n, k)), (odd, _fp8(n, k)),
                      (torch.randn(1, 96).bfloat16(), _w8(n, 96, dtype=torch.int8))]:
        assert not gemv_w8_mma.mma_ok(x, q)
        got = gemv_int8.qgemv(x, q, s, None, cfg)
        assert rel(got, _want(x, q, s, None)) < (1e-2 if x.dtype == torch.bfloat16 else 1e-5)
    from slipstream.kernels.reference import silu_and_mul

    q, s = _fp8(n, k)
    gate_up = torch.randn(1, 2 * k)
    got = gemv_int8.qgemv(gate_up, q, s, None, cfg, gated=True)
    assert rel(got, _want(silu_and_mul(gate_up), q, s, None)) < 1e-5
    with pytest.raises(ValueError, match="rows per warp"):
        gemv_int8.qgemv(torch.randn(1, k).bfloat16(), q, s, None, GemvConfig(48, 64, 0, 1,
                                                                              mma=True))


def test_w8_mma_candidates_only_when_enabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemv_w8_mma, "ENABLED", False)
    assert not any(c.mma for m in (1, 4, 16) for dtype in gemv_w8_mma.WEIGHT_DTYPES
                   for c in gemv_int8.candidate_qconfigs(m, dtype))
    monkeypatch.setattr(gemv_w8_mma, "ENABLED", True)
    for m in (1, 4, 16):
        for dtype in gemv_w8_mma.WEIGHT_DTYPES:
            assert any(c.mma for c in gemv_int8.candidate_qconfigs(m, dtype))


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("split,with_bias,prefetch", [(1, False, False), (3, True, True)])
def test_w8_mma_gate_out_equals_product_then_activation(dtype: torch.dtype, split: int,
                                                        with_bias: bool,
                                                        prefetch: bool) -> None:
    """One row, a [gate | up] weight (I = 40: the last program's columns partly past I), 32 rows
    a warp: the kernel pairs a gate tile with its up tile and writes SiLU(gate)·up, equal to
    silu_and_mul of the same config's stored product (operands rounded to bf16 first)."""

    n, k = 80, 192
    q, s = _w8(n, k, seed=5, dtype=dtype)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    cfg = GemvConfig(32, 64, split, 1, 1, prefetch, mma=True)
    assert gemv_int8._mma_gate_out(cfg, x, q)
    assert not gemv_int8._mma_gate_out(GemvConfig(16, 64, split, 1, mma=True), x, q)
    got = gemv_int8.qgemv_gate_out(x, q, s, b, cfg)
    check_gate_out(got, gemv_int8.qgemv(x, q, s, b, cfg))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_gpu_w8_mma_kernel(n: int, k: int, dtype: torch.dtype) -> None:
    """The PTX kernel on the Llama-3.1-8B shapes, 1-16 rows, its candidate tiles: within bf16
    rounding of the reference, run twice (split-K counters back at zero)."""
    q, s = _w8(n, k, "cuda", dtype=dtype)
    cfgs = [GemvConfig(16 * tiles * w, 64, sk, w, 1, pf, mma=True)
            for tiles, w, sk, pf in [(1, 4, 0, True), (2, 4, 0, True), (2, 8, 0, True),
                                     (1, 8, 0, True), (2, 4, 0, False), (2, 4, 2, True)]]
    for m in (1, 2, 3, 8, 11, 16):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = gemv_int8.qgemv_reference(x.float(), q, s)
        for cfg in cfgs:
            for _ in range(2):
                assert rel(gemv_int8.qgemv(x, q, s, None, cfg), want) < 8e-3, (m, cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_gpu_w8_mma_gate_out(dtype: torch.dtype) -> None:
    """The PTX kernel's gate-out on the Llama-3.1-8B gate/up shape equals silu_and_mul of its
    stored product, with and without split-K."""
    from slipstream.kernels.reference import silu_and_mul

    q, s = _w8(28672, 4096, "cuda", dtype=dtype)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    for cfg in [GemvConfig(128, 64, 0, 4, 1, True, mma=True),
                GemvConfig(256, 64, 2, 8, 1, True, mma=True)]:
        got = gemv_int8.qgemv_gate_out(x, q, s, None, cfg)
        want = silu_and_mul(gemv_int8.qgemv(x, q, s, None, cfg).float())
        torch.testing.assert_close(got.float(), want, atol=1e-3, rtol=1e-2)
