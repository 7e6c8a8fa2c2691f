"""Triton RMSNorm, residual-add RMSNorm and SiLU-and-mul against their reference twins."""
from __future__ import annotations

import pytest
import torch

from slipstream.kernels import reference
from slipstream.kernels.norm_act.activation import gelu_tanh_and_mul, silu_and_mul
from slipstream.kernels.norm_act.rms_norm import fused_add_rms_norm, rms_norm

pytestmark = pytest.mark.usefixtures("poison_outputs")
# float32 on the interpreter: same math as the reference up to summation order.
ATOL, RTOL = 1e-5, 1e-5


@pytest.mark.parametrize("shape", [(1, 64), (5, 100), (2, 3, 256)])
def test_rms_norm(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape) * 3
    w = torch.randn(shape[-1])
    torch.testing.assert_close(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6),
                               atol=ATOL, rtol=RTOL)


def test_rms_norm_strided_rows() -> None:
    base = torch.randn(6, 96)
    x = base[:, 16:80]  # rows with a stride wider than the row
    w = torch.randn(64)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5),
                               atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("shape", [(1, 64), (7, 200)])
def test_fused_add_rms_norm_in_place(shape: tuple[int, int]) -> None:
    x, res, w = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    want_out, want_res = reference.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    x_ptr, res_ptr = x.data_ptr(), res.data_ptr()
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(out, want_out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(new_res, want_res, atol=ATOL, rtol=RTOL)
    assert out.data_ptr() == x_ptr and new_res.data_ptr() == res_ptr  # storage reused


def test_fused_add_rms_norm_non_contiguous() -> None:
    x = torch.randn(4, 160)[:, :128]
    res = torch.randn(4, 256)[:, 64:192]
    w = torch.randn(128)
    want_out, want_res = reference.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(out, want_out, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(new_res, want_res, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("shape", [(1, 2 * 64), (3, 2 * 1500), (2, 2, 2 * 40)])
def test_silu_and_mul(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape) * 4
    torch.testing.assert_close(silu_and_mul(x), reference.silu_and_mul(x), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("shape", [(1, 2 * 64), (3, 2 * 1500)])
def test_gelu_tanh_and_mul(shape: tuple[int, ...]) -> None:
    x = torch.randn(shape) * 4
    want = reference.gelu_tanh_and_mul(x)
    torch.testing.assert_close(gelu_tanh_and_mul(x), want, atol=ATOL, rtol=RTOL)
    assert (want - reference.silu_and_mul(x)).abs().max() > 0.1  # a different activation


# ---------------------------------------------------------------------------- GPU (bf16)
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 33, 4096])
@pytest.mark.parametrize("hidden", [1024, 4096, 5120])
def test_gpu_norms_bf16(tokens: int, hidden: int) -> None:
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(tokens, hidden, device=dev, dtype=dt)
    res = torch.randn(tokens, hidden, device=dev, dtype=dt)
    w = torch.randn(hidden, device=dev, dtype=dt)
    # bf16 outputs of the same float32 math: at most a rounding step apart.
    torch.testing.assert_close(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6),
                               atol=2e-2, rtol=1e-2)
    want = reference.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-6)
    got = fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("inter", [3072, 14336])
def test_gpu_silu_and_mul_bf16(tokens: int, inter: int) -> None:
    x = torch.randn(tokens, 2 * inter, device="cuda", dtype=torch.bfloat16) * 4
    torch.testing.assert_close(silu_and_mul(x), reference.silu_and_mul(x), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(gelu_tanh_and_mul(x), reference.gelu_tanh_and_mul(x), atol=2e-2,
                               rtol=1e-2)
