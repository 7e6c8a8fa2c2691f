"""The one-row int4 GEMV with K over the warps (kernels/gemv_int4_kwarps.py) against the float64
reference: plain, 32-row tiles, gate-out, bias, the in-GEMV RMS norm, several tiles and steps a
program (CPU: the interpreter runs the mma twin and the plain loads; GPU: the PTX), its shape
checks and its place among the tuner's candidates."""
from __future__ import annotations

import pytest
import torch

from slipstream.kernels import gemv_int4, gemv_int4_kwarps
from slipstream.kernels.gemv_int4 import KWARPS_CONFIGS, W4Config, _kwarps_ok
from slipstream.kernels.reference import silu_and_mul
from tests.quantization.gemv_helpers import check_gate_out, quantized, rel, rms_normed


def _run(x, q, s, z, bias, warps, tiles, persist, gate_out=False, rms_eps=0.0):
    words = gemv_int4.packed_words(q, s, z, 128, x.shape[-1])
    n = q.shape[0]
    out = torch.empty(1, n // 2 if gate_out else n, dtype=torch.bfloat16, device=x.device)
    gemv_int4_kwarps.launch(x, words, s, z, bias, out, warps, tiles, persist, 2, {},
                            gate_out=gate_out, rms_eps=rms_eps)
    return out



@pytest.mark.parametrize("n,k,warps,tiles,persist,bias", [
    (48, 512, 4, 1, 1, False),    # one step a tile, three tiles over two programs
    (64, 1024, 4, 2, 1, True),    # 32-row tiles, two steps a tile, bias
    (96, 2048, 8, 1, 2, False),   # two steps, six tiles over four programs
    (80, 512, 4, 1, 1, False),    # five tiles over two programs: an odd count of steps
])
def test_kwarps_equals_the_reference(n, k, warps, tiles, persist, bias) -> None:
    q, s, z = quantized(n, k, 128, seed=n)
    x = torch.randn(1, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    got = _run(x, q, s, z, b, warps, tiles, persist)
    want = gemv_int4.w4_linear_reference(x.double(), q, s, z, 128,
                                         None if b is None else b.double())
    assert got.shape == (1, n) and rel(got, want) < 8e-3


@pytest.mark.parametrize("rms_eps,bias", [(0.0, False), (1e-5, True)])
def test_kwarps_gate_out_and_rms(rms_eps, bias) -> None:
    """Gate-out writes SiLU(gate)·up of the [gate | up] product at columns j (gate rows j, up
    rows I + j); rms_eps takes the product of x / rms(x)."""
    n, k = 96, 1024
    q, s, z = quantized(n, k, 128, seed=3)
    x = torch.randn(1, k).bfloat16() * 3
    b = torch.randn(n).bfloat16() if bias else None
    product = gemv_int4.w4_linear_reference(rms_normed(x, rms_eps) if rms_eps else x.double(),
                                            q, s, z, 128, None if b is None else b.double())
    got = _run(x, q, s, z, b, 4, 2, 1, gate_out=True, rms_eps=rms_eps)
    assert got.shape == (1, n // 2)
    assert rel(got, silu_and_mul(product.float())) < 1.5e-2
    if rms_eps:
        plain = _run(x, q, s, z, b, 4, 1, 1, rms_eps=rms_eps)
        assert rel(plain, product) < 8e-3


def test_w4_gemv_runs_a_kwarps_config_and_its_gate_out() -> None:
    """Through w4_gemv / w4_gemv_gate_out as the tuner calls them: the result, and the gate-out
    equal to silu_and_mul of the same config's stored product."""
    cfg = W4Config(32, 128, 1, 8, persist=1, kwarps=True)
    n, k = 64, 1024
    q, s, z = quantized(n, k, 128, seed=5)
    x = torch.randn(1, k).bfloat16()
    product = gemv_int4.w4_gemv(x, q, s, z, 128, None, cfg)
    assert rel(product, gemv_int4.w4_linear_reference(x.double(), q, s, z, 128)) < 8e-3
    check_gate_out(gemv_int4.w4_gemv_gate_out(x, q, s, z, 128, None, cfg), product)
    assert "k-warps" in cfg.label()


def test_kwarps_shape_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(1, 4096).bfloat16()
    assert gemv_int4_kwarps.fits(4096, 4096, 128, 32, 1)
    assert not gemv_int4_kwarps.fits(4096, 14336, 128, 32, 1)  # 112 groups over 32 warps
    assert gemv_int4_kwarps.fits(4096, 14336, 128, 16, 1)
    assert not gemv_int4_kwarps.fits(4104, 4096, 128, 8, 1)  # a partial 16-row tile
    assert not gemv_int4_kwarps.fits(4096, 4096, 64, 8, 1)  # groups of 64
    assert not gemv_int4_kwarps.fits(4096, 4096, 128, 8, 1, gate_out=True)  # gate-out: 2 tiles
    assert not gemv_int4_kwarps.x_ok(torch.randn(2, 4096).bfloat16())
    assert not gemv_int4_kwarps.x_ok(x.half())
    assert not gemv_int4_kwarps.x_ok(torch.randn(4100).bfloat16()[2:].view(1, 4098)[:, :4096])
    q, s, z = quantized(40, 512, 128)
    with pytest.raises(ValueError, match="k-warps"):
        _run(torch.randn(1, 512).bfloat16(), q, s, z, None, 4, 1, 1)
    # The tuner offers each config only where it runs.
    assert all(_kwarps_ok(c, x, 4096, 14336, 128) for c in KWARPS_CONFIGS)
    assert not _kwarps_ok(W4Config(16, 128, 1, 32, persist=1, kwarps=True), x, 4096, 14336, 128)
    assert all(_kwarps_ok(c, x, 4096, 4096, 128) for c in KWARPS_CONFIGS)
    assert not any(c.kwarps for c in gemv_int4.candidate_w4_configs(1))  # opt-in
    monkeypatch.setattr(gemv_int4, "_KWARPS", True)
    assert all(c in gemv_int4.candidate_w4_configs(1) for c in KWARPS_CONFIGS)
    assert not any(c.kwarps for c in gemv_int4.candidate_w4_configs(4))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", KWARPS_CONFIGS, ids=lambda c: c.label())
def test_gpu_kwarps_configs_on_llama_shapes(cfg) -> None:
    """Every tuner config on the Llama-3.1-8B one-row shapes it takes: plain (with bias), the
    gate_up gate-out and the in-GEMV norm, against the float64 reference."""
    torch.manual_seed(0)
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        q, s, z = quantized(n, k, 128, device="cuda")
        if not _kwarps_ok(cfg, x, n, k, 128):
            continue
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        got = gemv_int4.w4_gemv(x, q, s, z, 128, b, cfg)
        assert rel(got, gemv_int4.w4_linear_reference(x.double(), q, s, z, 128, b.double())) < 8e-3
        normed = gemv_int4.w4_gemv(x, q, s, z, 128, None, cfg, rms_eps=1e-5)
        assert rel(normed, gemv_int4.w4_linear_reference(rms_normed(x, 1e-5), q, s, z, 128)) < 8e-3
        if _kwarps_ok(cfg, x, n, k, 128, gate_out=True):
            product = gemv_int4.w4_gemv(x, q, s, z, 128, None, cfg)
            check_gate_out(gemv_int4.w4_gemv_gate_out(x, q, s, z, 128, None, cfg), product)
