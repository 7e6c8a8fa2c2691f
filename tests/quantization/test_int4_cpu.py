"""int4 layers on a CPU through torch's bf16 int4 GEMM (quantization/int4_cpu.py) against the
float32 reference twin."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import slipstream.quantization.utils as qu
from slipstream.kernels.gemv.int4_common import w4_linear_reference
from slipstream.quantization import int4_cpu

pytestmark = pytest.mark.skipif(not int4_cpu._HAS_KERNEL, reason="this torch has no CPU int4 GEMM")

# x and the (scale, offset) pairs are rounded to bf16 and the output is bf16: about 2^-8 of the
# output's scale; a wrong group, zero or nibble order is off by the weights' own scale.
TOL = 2e-2


def _layer(n: int, k: int, group: int, float_zeros: bool, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    groups = qu.int4_groups(k, group)
    layer = nn.Module()
    layer.qweight = nn.Parameter(qu.pack_int4_rows(
        torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)), requires_grad=False)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).half()
    layer.scales = nn.Parameter(scales, requires_grad=False)
    if float_zeros:  # GGUF Q4_1: w = q s - zs
        zeros = (torch.rand(n, groups, generator=gen) * 16 * scales.float()).half()
    else:
        zeros = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8)
    layer.zeros = nn.Parameter(zeros, requires_grad=False)
    return layer


def _reference(layer: nn.Module, x: torch.Tensor, group: int, bias=None) -> torch.Tensor:
    return w4_linear_reference(x, layer.qweight, layer.scales, layer.zeros, group, bias)


@pytest.mark.parametrize("float_zeros", [False, True], ids=["uint8 zeros", "float zeros"])
@pytest.mark.parametrize(("n", "k", "group"), [
    (64, 576, 32), (64, 576, 64),
    (48, 576, 128),  # K = 4.5 groups: a short last group, sub-groups of 64
    (32, 576, 576),  # one group per row, sub-groups of 64
    (32, 192, 96),  # a group of 96: sub-groups of 32
    (16, 512, 256),
])
@pytest.mark.parametrize("rows", [1, 5, int4_cpu.MAX_ROWS])
def test_int4_gemm_equals_the_reference(n, k, group, float_zeros, rows) -> None:
    layer = _layer(n, k, group, float_zeros)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(n)
    got = int4_cpu.linear(layer, x, group, bias)
    assert got is not None and got.dtype == x.dtype and got.shape == (rows, n)
    want = _reference(layer, x, group, bias)
    err = (got - want).abs().max() / want.abs().max()
    assert err < TOL, f"relative error {err:.2e}"


def test_a_batch_of_sequences_keeps_its_leading_dims() -> None:
    layer = _layer(32, 128, 64, False)
    x = torch.randn(2, 3, 128)
    got = int4_cpu.linear(layer, x, 64, None)
    assert got.shape == (2, 3, 32)
    want = _reference(layer, x.reshape(6, 128), 64).reshape(2, 3, 32)
    assert (got - want).abs().max() / want.abs().max() < TOL


@pytest.mark.parametrize(("n", "k", "group", "rows"), [
    (24, 128, 64, 1),  # N not a multiple of 16
    (32, 80, 80, 1),  # no sub-group of 32 divides K
    (32, 160, 20, 1),  # a group of 20
    (32, 128, 64, int4_cpu.MAX_ROWS + 1),  # more rows: dequantize + F.linear wins
])
def test_other_layers_and_batches_keep_the_reference(n, k, group, rows) -> None:
    layer = _layer(n, k, group, False)
    assert int4_cpu.linear(layer, torch.randn(rows, k), group, None) is None


def test_replaced_weights_are_packed_again() -> None:
    """process_after_loading calls forget: a layer whose weights change never runs a stale
    packed copy."""
    layer = _layer(32, 128, 64, False, seed=0)
    x = torch.randn(1, 128)
    int4_cpu.linear(layer, x, 64, None)
    fresh = _layer(32, 128, 64, False, seed=7)
    layer.qweight, layer.scales, layer.zeros = fresh.qweight, fresh.scales, fresh.zeros
    int4_cpu.forget(layer)
    got = int4_cpu.linear(layer, x, 64, None)
    want = _reference(fresh, x, 64)
    assert (got - want).abs().max() / want.abs().max() < TOL
