"""One-launch per-token FP8 quantization against its torch twin (quantize_per_token), and the
fused variants (SiLU-and-mul, RMSNorm) against the unfused kernels they replace."""
from __future__ import annotations

import pytest
import torch

from slipstream.kernels.norm_act import rms_norm as norm_kernels
from slipstream.kernels.norm_act.quant_act import (
    quantize_per_token_fp8,
    rms_norm_quant_fp8,
    silu_and_mul_quant_fp8,
)
from slipstream.kernels.reference import silu_and_mul
from slipstream.quantization.utils import FP8_DTYPE, quantize_per_token


# One pass with the row in registers up to 16384 values, two passes past that (20000).
@pytest.mark.parametrize("m,k", [(1, 300), (5, 2048), (3, 1030), (3, 20000)])
def test_matches_torch_twin(m: int, k: int) -> None:
    x = torch.randn(m, k) * torch.logspace(-3, 3, m).unsqueeze(1)
    x[0, :7] = 0.0
    if m > 2:
        x[2] = 0.0  # an all-zero row: the scale floor keeps it finite
    q, s = quantize_per_token_fp8(x)
    want_q, want_s = quantize_per_token(x, FP8_DTYPE)
    assert q.dtype == FP8_DTYPE and s.shape == (m, 1)
    torch.testing.assert_close(s, want_s, rtol=0, atol=0)
    # Triton's interpreter casts float32 -> e4m3 wrongly near binade edges (125.9 -> 64, ties
    # away from even), so the bytes are compared only where the value is exactly representable;
    # the GPU test compares every byte.
    exact = want_q.float() == (x / want_s).clamp(-448, 448)
    assert exact.sum() >= 7
    assert torch.equal(q.view(torch.uint8)[exact], want_q.view(torch.uint8)[exact])


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(1, 4096), (512, 14336), (8192, 4096), (64, 20000)])
def test_gpu_matches_torch_twin(m: int, k: int) -> None:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_per_token_fp8(x)
    want_q, want_s = quantize_per_token(x, FP8_DTYPE)
    torch.testing.assert_close(s, want_s, rtol=1e-6, atol=0)
    _assert_fp8_codes_close(q, want_q)


def _assert_fp8_codes_close(q: torch.Tensor, want_q: torch.Tensor) -> None:
    """Triton's float32 division is not correctly rounded on the GPU: a value on a rounding
    edge may land on the neighbouring e4m3 code (same sign, codes one apart), and rarely."""
    codes, want_codes = q.view(torch.uint8).int(), want_q.view(torch.uint8).int()
    assert (codes - want_codes).abs().max() <= 1
    assert (codes != want_codes).float().mean() < 1e-4


@pytest.mark.parametrize("m,n", [(1, 300), (4, 1030), (2, 17000)])
def test_silu_and_mul_quant_matches_twin(m: int, n: int) -> None:
    gate_up = torch.randn(m, 2 * n) * 3
    gate_up[0, n:n + 5] = 0.0  # zero up: zero activations
    q, s = silu_and_mul_quant_fp8(gate_up)
    h = silu_and_mul(gate_up)
    want_q, want_s = quantize_per_token(h, FP8_DTYPE)
    assert q.shape == (m, n) and q.dtype == FP8_DTYPE
    torch.testing.assert_close(s, want_s, rtol=1e-6, atol=0)
    exact = want_q.float() == (h / want_s).clamp(-448, 448)  # see test_matches_torch_twin
    assert exact.sum() >= 5
    assert torch.equal(q.view(torch.uint8)[exact], want_q.view(torch.uint8)[exact])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 512, 4096])
def test_gpu_silu_and_mul_quant_matches_twin(m: int) -> None:
    from slipstream.kernels.norm_act.activation import silu_and_mul as silu_and_mul_triton

    gate_up = torch.randn(m, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    q, s = silu_and_mul_quant_fp8(gate_up)
    # The unfused path the fused kernel replaces: the Triton activation (same float formula),
    # then the twin quantizer.
    want_q, want_s = quantize_per_token(silu_and_mul_triton(gate_up), FP8_DTYPE)
    torch.testing.assert_close(s, want_s, rtol=1e-6, atol=0)
    _assert_fp8_codes_close(q, want_q)


def _unfused_norm_quant(x, w, residual):
    """What the fp8 linear layer ran before the fusion: the Triton norm, then the quantizer."""
    if residual is None:
        h, new_res = norm_kernels.rms_norm(x, w, 1e-5), None
    else:
        h, new_res = norm_kernels.fused_add_rms_norm(x.clone(), residual.clone(), w, 1e-5)
    q, s = quantize_per_token_fp8(h)
    return q, s, new_res


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_quant_matches_the_unfused_kernels(dtype, with_residual: bool) -> None:
    m, k = 5, 1030
    x = (torch.randn(m, k) * torch.logspace(-2, 2, m).unsqueeze(1)).to(dtype)
    residual = torch.randn(m, k, dtype=dtype) if with_residual else None
    w = torch.rand(k, dtype=dtype) + 0.5
    want_q, want_s, want_res = _unfused_norm_quant(x, w, residual)
    res_in = residual.clone() if with_residual else None
    q, s, new_res = rms_norm_quant_fp8(x, w, 1e-5, res_in)
    assert q.shape == (m, k) and q.dtype == FP8_DTYPE and s.shape == (m, 1)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    if with_residual:
        assert torch.equal(new_res, want_res)
        assert new_res.data_ptr() == res_in.data_ptr()  # written in place, like the norm kernel
    else:
        assert new_res is None


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 512, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu_norm_quant_matches_the_unfused_kernels(m: int, with_residual: bool) -> None:
    k = 4096
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x) if with_residual else None
    w = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
    want_q, want_s, want_res = _unfused_norm_quant(x, w, residual)
    q, s, new_res = rms_norm_quant_fp8(x, w, 1e-5, residual.clone() if with_residual else None)
    # Bit-equal in the interpreter (above); compiled, the two kernels sum the squares in
    # different orders and divide differently: a row's largest normed value may round to the
    # neighbouring bf16 (its scale one bf16 ulp, 2^-7, apart; H200: 1 row of 4096), its codes
    # then one apart where they sit on an edge.
    torch.testing.assert_close(s, want_s, rtol=2**-7, atol=0)
    assert (s != want_s).float().mean() <= 2 / m + 1e-3
    _assert_fp8_codes_close(q, want_q)
    if with_residual:
        assert torch.equal(new_res, want_res)
