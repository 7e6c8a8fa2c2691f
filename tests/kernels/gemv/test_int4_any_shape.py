"""The W4A16 kernels for any group size (32, 64, 128, per channel) and K that the group does not
divide (a short last group), N not a multiple of 8: each kernel against the reference twin, in
Triton's interpreter on the CPU (tiny shapes), and on the GPU (`-m gpu`) at SmolLM2-135M's shapes.
"""

from __future__ import annotations

import pytest
import torch

from slipstream.kernels.gemm import int4 as gemm_int4
from slipstream.kernels.gemv import int4 as gemv_int4
from slipstream.kernels.gemv.int4 import W4Config
from slipstream.quantization import utils as qu
from tests.kernels.gemv.gemv_helpers import quantized, rel

# (K, group): a short last group of 64 (320 = 2.5 x 128), of 32 (96 = 1.5 x 64), of 16
# (80 = 2.5 x 32), and one group a row (per channel, K itself).
SHAPES = [(320, 128), (96, 64), (80, 32), (320, 320)]
N = 37  # not a multiple of 8 (nor of the tiles)


def _want(x: torch.Tensor, packed, group: int, bias: torch.Tensor | None = None):
    return gemv_int4.w4_linear_reference(x.double(), *packed, group, None if bias is None else bias.double())


def test_short_last_group_is_the_zero_padded_group() -> None:
    """A short last group quantizes as the group padded with zero columns would (the pad holds
    the zero point: exactly 0 after dequantization), and the reference drops nothing."""
    w = torch.randn(N, 80)
    q, s, z = qu.quantize_int4_groupwise(w, 32)
    qp, sp, zp = qu.quantize_int4_groupwise(qu.pad_to_groups(w, 32), 32)
    assert s.shape == (N, 3) and torch.equal(s, sp) and torch.equal(z, zp)
    assert torch.equal(q, qp[:, :80]) and torch.equal(qp[:, 80:], zp[:, 2:].expand(N, 16))
    deq = qu.dequantize_int4_groupwise(q, s, z, group_size=32)
    step = s.repeat_interleave(32, dim=1)[:, :80]
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="pass the group size"):
        qu.dequantize_int4_groupwise(q, s, z)


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("k,group", SHAPES)
@pytest.mark.parametrize("m", [1, 3])
def test_w4_gemv_fma_and_tensor_core_rows(k: int, group: int, m: int) -> None:
    """M == 1: the float32 FMA kernel with a K split that ends inside the short group; M == 3:
    the tensor-core kernel; float32 x, bias."""
    packed = quantized(N, k, group, seed=k + group)
    x, b = torch.randn(m, k), torch.randn(N)
    cfg = W4Config(block_n=16, block_k=128, split_k=2, num_warps=2, prefetch=True, dot=m > 1)
    got = gemv_int4.w4_gemv(x, *packed, group, b, cfg)
    assert rel(got, _want(x, packed, group, b)) < 1e-5


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("k,group", [(320, 128), (96, 64)])
def test_w4_gemv_bf16_paths(k: int, group: int) -> None:
    """bf16 x: the chained packed-bf16 one-row kernel (loop and whole-K) and the two-row
    kernel, within bf16 output rounding of the reference."""
    packed = quantized(N, k, group, seed=3)
    x = torch.randn(2, k).bfloat16()
    chained = W4Config(block_n=16, block_k=128, split_k=1, num_warps=2, prefetch=True, bit_convert=2)
    whole = W4Config(
        block_n=8, block_k=128, split_k=1, num_warps=4, prefetch=True, bit_convert=2, whole_k=True
    )
    two = W4Config(
        block_n=16, block_k=128, split_k=2, num_warps=2, prefetch=True, bit_convert=2, two_rows=True
    )
    for cfg in (chained, whole):
        assert rel(gemv_int4.w4_gemv(x[:1], *packed, group, None, cfg), _want(x[:1], packed, group)) < 8e-3
    assert rel(gemv_int4.w4_gemv(x, *packed, group, None, two), _want(x, packed, group)) < 8e-3


@pytest.mark.usefixtures("poison_outputs")
def test_w4_gate_out_with_a_short_group() -> None:
    n, k, group = 2 * 21, 96, 64
    packed = quantized(n, k, group, seed=9)
    x = torch.randn(1, k).bfloat16()
    cfg = W4Config(block_n=8, block_k=128, split_k=1, num_warps=2, prefetch=True, bit_convert=2)
    got = gemv_int4.w4_gemv_gate_out(x, *packed, group, None, cfg)
    product = _want(x, packed, group)
    want = torch.nn.functional.silu(product[:, :21]) * product[:, 21:]
    assert rel(got, want) < 1e-2


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("k,group", SHAPES)
def test_w4_gemm_and_dequantize(k: int, group: int) -> None:
    packed = quantized(N, k, group, seed=7)
    x = torch.randn(20, k)
    got = gemm_int4.w4_gemm(x, *packed, group, None, gemm_int4.W4GemmConfig(16, 32, 128, 4, 1))
    assert rel(got, _want(x, packed, group)) < 1e-5
    deq = gemm_int4.w4_dequantize(*packed, group, torch.float32, kernel=True)
    want = qu.dequantize_int4_groupwise(qu.unpack_int4_rows(packed[0]), *packed[1:], group_size=group)
    torch.testing.assert_close(deq, want, atol=0, rtol=0)


def test_shapes_the_kernels_do_not_take_run_the_reference() -> None:
    """K or a group not a multiple of 16: int4_linear runs the reference twin (also on CUDA);
    the kernels themselves refuse it clearly."""
    packed = quantized(N, 40, 32)
    x = torch.randn(2, 40)
    torch.testing.assert_close(gemv_int4.int4_linear(x, *packed, 32), _want(x, packed, 32).float())
    with pytest.raises(ValueError, match="multiples of 16"):
        gemv_int4.w4_gemv(x, *packed, 32)


# --- GPU: SmolLM2-135M's projections (hidden 576, intermediate 1536), every group size -------

# (N, K): qkv, gate_up, down; N = 37 not a multiple of 8 or 16.
SMOLLM2 = [(576 * 3 // 2 + 192, 576), (2 * 1536, 576), (576, 1536), (37, 576)]


@pytest.mark.gpu
@pytest.mark.parametrize("group", [32, 64, 128, 0])
@pytest.mark.parametrize("n,k", SMOLLM2)
@pytest.mark.parametrize("m", [1, 16, 64])
def test_gpu_int4_linear_any_group(n: int, k: int, group: int, m: int) -> None:
    """The measured kernels (CUDA C++ one-row kernel where it takes the shape, Triton GEMV,
    GEMM or dequantize + cuBLAS) at every group size, K = 576 a short group at 128; at one row
    also the fused norm and the gate-out products."""
    group = group or k
    packed = quantized(n, k, group, device="cuda", seed=n + k)
    x = torch.randn(m, k, device="cuda").bfloat16()
    b = torch.randn(n, device="cuda").bfloat16()
    want = _want(x, packed, group, b)
    got = gemv_int4.int4_linear(x, *packed, group, b)
    assert rel(got, want) < 1e-2, (n, k, group, m)
    if m != 1:
        return
    rms = gemv_int4.w4_linear_small_rms(x, *packed, group, b, 1e-5)
    if rms is not None:
        xn = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
        assert rel(rms, _want(xn, packed, group, b)) < 1e-2
    if n % 2 == 0:
        gate_out = gemv_int4.w4_linear_small_gate_out(x, *packed, group, b)
        if gate_out is not None:
            half = n // 2
            silu = torch.nn.functional.silu(want[:, :half]) * want[:, half:]
            assert rel(gate_out, silu) < 2e-2
