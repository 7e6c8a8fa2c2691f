"""Triton W8A16 GEMM (kernels/gemm/int8.py, int8_wo above 16 rows) against its reference twin.

CPU: Triton's interpreter with float32 activations (bf16 tl.dot is wrong in the interpreter).
GPU (`-m gpu`): bf16 activations, every candidate tile on the Llama-3.1-8B layer shapes.
"""
from __future__ import annotations

import pytest
import torch

from slipstream.kernels.gemm import int8 as gemm_int8
from slipstream.kernels.gemm.int8 import W8GemmConfig
from slipstream.kernels.gemv.dense import COUNTERS
from slipstream.kernels.gemv.int8 import qgemv_reference
from slipstream.quantization import utils
from slipstream.quantization.int8_wo import convert_linear


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _qweight(n: int, k: int, device: str = "cpu", seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    return utils.quantize_int8_per_channel(torch.randn(n, k, generator=g, device=device))


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("cfg", [
    None,  # the default tile (64 x 128, K steps of 128)
    W8GemmConfig(16, 32, 64, 4, 1),
    W8GemmConfig(32, 16, 32, 2, 1, group_m=2),  # several row blocks walk the weight together
    W8GemmConfig(16, 32, 64, 4, 1, swap_ab=True),  # the product as w @ x^T
    W8GemmConfig(16, 32, 32, 4, 1, split_k=3),  # K shared by three programs a tile
    W8GemmConfig(32, 16, 64, 2, 1, swap_ab=True, split_k=16),  # capped at one per K step
])
@pytest.mark.parametrize("k", [256, 200])  # 200: the last K step is masked
@pytest.mark.parametrize("with_bias", [False, True])
def test_w8_gemm_matches_reference(cfg, k: int, with_bias: bool) -> None:
    n = 37  # not a multiple of any tile: the last column block re-reads row N-1, stores masked
    q, s = _qweight(n, k)
    x = torch.randn(2, 25, k)  # leading dims: M = 50, past one row block
    b = torch.randn(n) if with_bias else None
    out = gemm_int8.w8_gemm(x, q, s, b, cfg)
    assert out.shape == (2, 25, n) and out.dtype == torch.float32
    want = qgemv_reference(x.reshape(50, k), q, s, b)
    torch.testing.assert_close(out.reshape(50, n), want, atol=1e-4, rtol=1e-4)
    for buf in COUNTERS.values():  # split-K arrival counters are left at zero
        assert int(buf.abs().sum()) == 0


def test_w8_gemm_rejects_mismatched_shapes() -> None:
    q, s = _qweight(8, 64)
    with pytest.raises(ValueError, match="shapes do not match"):
        gemm_int8.w8_gemm(torch.randn(3, 32), q, s)
    with pytest.raises(ValueError, match="shapes do not match"):
        gemm_int8.w8_gemm(torch.randn(3, 64), q, s[:4])


def test_w8_gemm_empty_batch() -> None:
    q, s = _qweight(8, 64)
    assert gemm_int8.w8_gemm(torch.randn(0, 64), q, s).shape == (0, 8)


def test_int8_linear_large_on_cpu_runs_the_kernel_without_measuring() -> None:
    """Off CUDA nothing is timed or recorded (the tuner measures on the GPU only)."""
    q, s = _qweight(24, 128)
    x = torch.randn(40, 128)
    before = dict(gemm_int8._LARGE_CHOICES)
    got = gemm_int8.int8_linear_large(x, q, s)
    torch.testing.assert_close(got, qgemv_reference(x, q, s), atol=1e-4, rtol=1e-4)
    assert gemm_int8._LARGE_CHOICES == before


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096),
                                 (333, 50)])
@pytest.mark.parametrize("m", [17, 40, 300, 2048])
def test_w8_gemm_gpu_every_candidate(m: int, k: int, n: int) -> None:
    """bf16 activations on the GPU: every tile the tuner may pick, the default, convert + cuBLAS
    and the measured choice (int8_linear, which int8_wo's apply calls), all within 1% of the
    float32 product (bf16 output rounding and float32 accumulation order)."""
    from slipstream.quantization.int8_wo import int8_linear

    q, s = _qweight(n, k, "cuda", seed=m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    want = qgemv_reference(x.float(), q, s, b.float())
    bucket = gemm_int8.large_m_bucket(m)
    splits = [W8GemmConfig(32, 64, 256, 4, 4, split_k=4),  # --sweep's split-K tiles
              W8GemmConfig(64, 128, 128, 4, 4, swap_ab=True, split_k=2)] if m <= 64 else []
    for cfg in [None, *gemm_int8.candidate_gemm_configs(bucket), *splits]:
        for _ in range(2):  # twice: the split-K counters are back at zero after a call
            got = gemm_int8.w8_gemm(x, q, s, b, cfg)
            assert got.dtype == torch.bfloat16 and _rel(got, want) < 1e-2, cfg
    assert _rel(convert_linear(x, q, s, b), want) < 1e-2
    assert _rel(int8_linear(x, q, s, b), want) < 1e-2
    key = (bucket, n, k, torch.bfloat16, True, x.device.index)
    assert key in gemm_int8._LARGE_CHOICES  # measured once, then reused


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("swap_ab", [False, True])
def test_w8_gemm_gpu_converts_every_int8_value_exactly(dtype: torch.dtype, swap_ab: bool) -> None:
    """The in-register conversion on the hardware: identity rows of x pick single weights, so
    the output is each stored value times its scale of 1, exact."""
    k = 256
    ar = torch.arange(k, device="cuda")
    # Row n holds every value, shifted by n: each value in every byte lane of the packed words.
    q = ((ar[None, :] + ar[:64, None]) % 256 - 128).to(torch.int8)
    x = torch.eye(k, device="cuda", dtype=dtype)
    s = torch.ones(64, device="cuda")
    cfg = W8GemmConfig(64, 64, 64, 4, 2, swap_ab=swap_ab)
    got = gemm_int8.w8_gemm(x, q, s, None, cfg)
    assert torch.equal(got, q.t().to(dtype))
