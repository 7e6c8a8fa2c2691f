"""Float zero points in the int4 layout (GGUF Q4_1: w = q d + m, kept as zeros = -m, the zero
point times the scale, w = q s - zeros): the reference twin exact, every int4 kernel against it
(CPU: Triton's interpreter, tiny shapes; GPU `-m gpu`: each kernel variant at SmolLM2's
shapes, the asm paths included)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slipstream.kernels.gemm import int4 as gemm_int4
from slipstream.kernels.gemv import int4 as gemv_int4
from slipstream.kernels.gemv import int4_mma as gemv_int4_mma
from slipstream.kernels.gemv.int4 import W4Config
from slipstream.kernels.reference import silu_and_mul
from slipstream.quantization import utils as qu
from tests.kernels.gemv.gemv_helpers import quantized_float_zeros, rel, rms_normed

N, K, G = 42, 96, 32  # three GGUF blocks a row; N even for the gate-out kernels

# bf16 output rounding; a zero correction missing or applied per the wrong columns is off by
# tens of percent (the weights are offset from zero, so sum(x) matters).
BF16_TOL = 8e-3

ONE_ROW_BF16 = {
    "bf16x2": W4Config(block_n=16, block_k=128, split_k=2, num_warps=2, prefetch=True, bit_convert=1),
    "chained": W4Config(block_n=16, block_k=128, split_k=1, num_warps=2, prefetch=True, bit_convert=2),
    "whole-k": W4Config(
        block_n=8, block_k=128, split_k=1, num_warps=4, prefetch=True, bit_convert=2, whole_k=True
    ),
    "whole-k-loop": W4Config(
        block_n=8, block_k=128, split_k=1, num_warps=4, prefetch=True, bit_convert=2, whole_k=True, persist=1
    ),
}


def _want(x: torch.Tensor, packed, group: int = G, bias: torch.Tensor | None = None):
    return gemv_int4.w4_linear_reference(x.double(), *packed, group, None if bias is None else bias.double())


@pytest.fixture(scope="module")
def packed():
    return quantized_float_zeros(N, K, G, seed=1)


def test_reference_dequantizes_q_d_plus_m_exactly(packed) -> None:
    """w = q d + m in float32, bit for bit (as gguf's own dequantize computes a Q4_1 block),
    the constant group (d = 0) included; the kernels' dequantize pass agrees exactly."""
    q = qu.unpack_int4_rows(packed[0])
    d, m = packed[1].float(), -packed[2].float()
    want = (q.float().reshape(N, -1, G) * d[..., None] + m[..., None]).reshape(N, K)
    got = qu.dequantize_int4_groupwise(q, *packed[1:], group_size=G)
    assert torch.equal(got, want) and torch.all(got[0, :G] == m[0, 0])
    assert torch.equal(gemm_int4.w4_dequantize(*packed, G, torch.float32, kernel=True), want)


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("k", [96, 80])  # 80: a short last group of 16
@pytest.mark.parametrize("m", [1, 3])
def test_float32_fma_and_tensor_core_rows(k: int, m: int) -> None:
    """float32 x: the one-row FMA kernel with a K split, and the tensor-core kernel, with a
    bias, within float32 rounding of the reference."""
    packed = quantized_float_zeros(N, k, G, seed=k)
    x, b = torch.randn(m, k), torch.randn(N)
    cfg = W4Config(block_n=16, block_k=128, split_k=2, num_warps=2, prefetch=True, dot=m > 1)
    assert rel(gemv_int4.w4_gemv(x, *packed, G, b, cfg), _want(x, packed, G, b)) < 1e-5


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("name", list(ONE_ROW_BF16))
def test_bf16_one_row_paths_plain_gate_out_and_norm(packed, name: str) -> None:
    """bf16 x, one row: the packed-bf16 kernels (per-word sums, chained, whole-K, whole-K
    loop) as the plain product, the gate-out product and with the folded norm (rms_eps)."""
    cfg = ONE_ROW_BF16[name]
    g = torch.Generator().manual_seed(2)
    x, b = (3 * torch.randn(1, K, generator=g)).bfloat16(), torch.randn(N, generator=g).bfloat16()
    assert rel(gemv_int4.w4_gemv(x, *packed, G, b, cfg), _want(x, packed, G, b)) < BF16_TOL
    got = gemv_int4.w4_gemv_gate_out(x, *packed, G, b, cfg)
    assert rel(got, silu_and_mul(_want(x, packed, G, b).bfloat16().double())) < 2 * BF16_TOL
    normed = _want(rms_normed(x, 1e-6), packed, G, b)
    got = gemv_int4.w4_gemv(x, *packed, G, b, cfg, rms_eps=1e-6)
    assert rel(got, normed) < BF16_TOL


@pytest.mark.usefixtures("poison_outputs")
def test_bf16_few_rows_kernels(packed) -> None:
    """Two rows (per-word and chained sums) and four rows of bf16 x."""
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(4)).bfloat16()
    for chain in (1, 2):
        two = W4Config(
            block_n=16, block_k=128, split_k=2, num_warps=2, prefetch=True, bit_convert=chain, two_rows=True
        )
        assert rel(gemv_int4.w4_gemv(x[:2], *packed, G, None, two), _want(x[:2], packed)) < BF16_TOL
    four = W4Config(
        block_n=16, block_k=128, split_k=1, num_warps=2, prefetch=True, bit_convert=2, four_rows=True
    )
    assert rel(gemv_int4.w4_gemv(x, *packed, G, None, four), _want(x, packed)) < BF16_TOL


@pytest.mark.usefixtures("poison_outputs")
def test_bf16_chained_runs_of_a_group_of_128() -> None:
    """Groups of 128 (sixteen words a chunk row: four runs per group in the chained sums), one
    row and two, K = 320 with a short last group of 64."""
    packed = quantized_float_zeros(N, 320, 128, seed=6)
    x = torch.randn(2, 320, generator=torch.Generator().manual_seed(6)).bfloat16()
    one = ONE_ROW_BF16["chained"]
    two = dataclasses.replace(one, two_rows=True)
    assert rel(gemv_int4.w4_gemv(x[:1], *packed, 128, None, one), _want(x[:1], packed, 128)) < BF16_TOL
    assert rel(gemv_int4.w4_gemv(x, *packed, 128, None, two), _want(x, packed, 128)) < BF16_TOL


@pytest.mark.usefixtures("poison_outputs")
def test_mma_kernel_at_groups_of_128() -> None:
    """The tensor-core fragment kernel (groups of 128) with float zeros, a K split."""
    packed = quantized_float_zeros(45, 256, 128, seed=3)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    cfg = W4Config(16, 128, 2, 1, 1, mma=True)
    assert gemv_int4_mma.mma_ok(x, 128)
    got = gemv_int4.w4_gemv(x, *packed, 128, None, cfg)
    assert rel(got, _want(x, packed, 128)) < BF16_TOL


@pytest.mark.usefixtures("poison_outputs")
def test_gemm(packed) -> None:
    x = torch.randn(20, K)
    got = gemm_int4.w4_gemm(x, *packed, G, None, gemm_int4.W4GemmConfig(16, 32, 128, 4, 1))
    assert rel(got, _want(x, packed)) < 1e-5


def test_float_zeros_are_tuned_apart_and_other_zeros_refused(packed) -> None:
    """Float and integer zeros of one shape are different kernels: the tuner keys them apart;
    zeros neither uint8 nor float are refused clearly."""
    x = torch.randn(1, K, dtype=torch.bfloat16)
    q, s, _ = packed
    with pytest.raises(ValueError, match="zeros"):
        gemv_int4.w4_gemv(x, q, s, torch.zeros(N, 3, dtype=torch.int32), G)
    cfg = W4Config(128, 128, 0, 2, 1, True)
    key = (1, N, K, G, torch.bfloat16, False, None, "float-zero")
    tables = {key: cfg, key[:7]: dataclasses.replace(cfg, block_n=64)}
    with pytest.MonkeyPatch.context() as mp:
        for k_, v in tables.items():
            mp.setitem(gemv_int4._SMALL_CHOICES, k_, v)
        choices = gemv_int4.w4_choices()
    assert f"M<=1 N={N} K={K} G={G} bfloat16 float-zero" in choices
    assert f"M<=1 N={N} K={K} G={G} bfloat16" in choices


# --- GPU: SmolLM2-135M's projections at group 32, every kernel variant ----------------------

SMOLLM2 = [(576 + 2 * 192, 576), (2 * 1536, 576), (576, 1536)]  # qkv, gate_up, down
GPU_CONFIGS = {
    "fma": W4Config(128, 128, 0, 2, 1, True),
    **ONE_ROW_BF16,
    "chained-split": W4Config(128, 128, 4, 8, 1, True, bit_convert=2),
    "chained-prefetch2": W4Config(64, 128, 0, 4, 1, 2, bit_convert=2),
    "whole-k-wide": W4Config(32, 128, 1, 8, 1, True, bit_convert=2, whole_k=True),
    "whole-k-loop-2": W4Config(8, 128, 1, 4, 1, True, bit_convert=2, whole_k=True, persist=2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SMOLLM2)
def test_gpu_every_kernel_variant_with_float_zeros(n: int, k: int) -> None:
    """Each one-row variant (the PTX packed-bf16 products) plain, gate-out and with the folded
    norm; the few-row, tensor-core and GEMM kernels; then int4_linear's measured choice at
    1, 4 and 64 rows. bf16 x, group 32."""
    packed = quantized_float_zeros(n, k, G, device="cuda", seed=n + k)
    gen = torch.Generator(device="cuda").manual_seed(k)
    x = (3 * torch.randn(64, k, device="cuda", generator=gen)).bfloat16()
    b = torch.randn(n, device="cuda", generator=gen).bfloat16()
    want = _want(x, packed, G, b)
    for name, cfg in GPU_CONFIGS.items():
        assert rel(gemv_int4.w4_gemv(x[:1], *packed, G, b, cfg), want[:1]) < 1e-2, name
        normed = _want(rms_normed(x[:1], 1e-5), packed, G, b)
        got = gemv_int4.w4_gemv(x[:1], *packed, G, b, cfg, rms_eps=1e-5)
        assert rel(got, normed) < 1e-2, name
        if n % 2 == 0:
            got = gemv_int4.w4_gemv_gate_out(x[:1], *packed, G, b, cfg)
            assert rel(got, silu_and_mul(want[:1].bfloat16().double())) < 2e-2, name
    for rows, cfgs in (
        (2, gemv_int4._few_rows_configs(2, torch.bfloat16)),
        (4, gemv_int4._few_rows_configs(4, torch.bfloat16)),
        (16, [gemv_int4.default_w4_config(16)]),
    ):
        for cfg in cfgs:
            got = gemv_int4.w4_gemv(x[:rows], *packed, G, b, cfg)
            assert rel(got, want[:rows]) < 1e-2, cfg.label()
    for cfg in gemm_int4.candidate_gemm_configs(64):
        assert rel(gemm_int4.w4_gemm(x, *packed, G, b, cfg), want) < 1e-2, cfg.label()
    for m in (1, 4, 64):  # the measured choice (each bucket is tuned: kept few)
        assert rel(gemv_int4.int4_linear(x[:m], *packed, G, b), want[:m]) < 1e-2, m


@pytest.mark.gpu
def test_gpu_mma_kernel_with_float_zeros() -> None:
    packed = quantized_float_zeros(2 * 1536, 1024, 128, device="cuda", seed=5)
    x = torch.randn(16, 1024, device="cuda").bfloat16()
    want = _want(x, packed, 128)
    for cfg in gemv_int4._mma_configs(16, torch.bfloat16):
        for m in (2, 16):
            got = gemv_int4.w4_gemv(x[:m], *packed, 128, None, cfg)
            assert rel(got, want[:m]) < 1e-2, (m, cfg.label())
