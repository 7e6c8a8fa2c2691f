"""Quant helpers and methods: round trips with error bounds, reference apply vs dequantized math."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.layers.linear import ColumnParallelLinear, QKVParallelLinear
from slipstream.quantization import int8_wo, utils
from slipstream.quantization.base import get_quant_method_factory
from slipstream.quantization.fp8 import fp8_linear_reference
from tests.helpers import rel_err, skip_without_fp8


def test_int8_per_channel_round_trip() -> None:
    w = torch.randn(64, 256) * torch.logspace(-2, 1, 64)[:, None]  # rows of very different size
    q, s = utils.quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (64,)
    err = (utils.dequantize_per_channel(q, s) - w).abs()
    # Round to nearest: at most half a step per element, per row.
    assert (err <= s[:, None] / 2 + 1e-6).all()
    assert q.abs().amax(dim=1).eq(127).all()


def test_fp8_per_channel_round_trip() -> None:
    w = torch.randn(32, 128)
    q, s = utils.quantize_fp8_per_channel(w)
    assert q.dtype == utils.FP8_DTYPE
    assert rel_err(utils.dequantize_per_channel(q, s), w) < 0.04  # E4M3: 3 mantissa bits


@pytest.mark.parametrize("qdtype,bound", [(torch.int8, 0.01), (utils.FP8_DTYPE, 0.04)])
def test_per_token_round_trip(qdtype: torch.dtype, bound: float) -> None:
    x = torch.randn(9, 200) * torch.rand(9, 1) * 10
    x[3] = 0.0  # an all-zero token must not divide by zero
    q, s = utils.quantize_per_token(x, qdtype)
    back = q.float() * s
    assert torch.isfinite(back).all() and back[3].abs().max() == 0
    assert rel_err(back, x) < bound


def test_int4_groupwise_round_trip_and_packing() -> None:
    w = torch.randn(16, 256)
    q, s, z = utils.quantize_int4_groupwise(w, 64)
    assert q.max() <= 15 and s.shape == (16, 4) and z.shape == (16, 4)
    err = (utils.dequantize_int4_groupwise(q, s, z) - w).abs().reshape(16, 4, 64)
    assert (err <= s[..., None] / 2 + 1e-5).all()
    assert torch.equal(utils.unpack_int4_rows(utils.pack_int4_rows(q)), q)
    for order in (utils.AWQ_ORDER, tuple(range(8))):
        packed = utils.pack_int32_cols(q, order)
        assert packed.dtype == torch.int32 and packed.shape == (16, 32)
        assert torch.equal(utils.unpack_int32_cols(packed, order), q)
    # AWQ's documented interleave: the second nibble of a word is column 2.
    one = torch.zeros(1, 8, dtype=torch.uint8)
    one[0, 2] = 5
    assert utils.pack_int32_cols(one, utils.AWQ_ORDER).item() == 5 << 4


def _layer(method: str, fused: bool) -> torch.nn.Module:
    factory = get_quant_method_factory(method, {})
    if fused:
        layer = QKVParallelLinear(64, 16, 4, 2, bias=True, params_dtype=torch.float32,
                                  quant_method=factory("qkv"))
    else:
        layer = ColumnParallelLinear(64, 48, bias=True, params_dtype=torch.float32,
                                     quant_method=factory("x"))
    w = torch.randn(layer.output_size, 64)
    for shard in range(len(layer.output_sizes)) if fused else [None]:
        lo = sum(layer.output_sizes[:shard]) if fused else 0
        size = layer.output_sizes[shard] if fused else layer.output_size
        layer.weight_loader(layer.weight, w[lo:lo + size], shard)
    layer.bias.data.normal_()
    layer.quant_method.process_after_loading(layer)
    return layer, w


@pytest.mark.parametrize("fused", [False, True])
def test_int8_wo_apply_matches_dequantized(fused: bool) -> None:
    layer, w = _layer("int8_wo", fused)
    assert layer.weight.dtype == torch.int8
    x = torch.randn(int8_wo._CPU_PACKED_MAX_M + 1, 64)  # above the bf16 path's rows: exact
    deq = utils.dequantize_per_channel(layer.weight, layer.weight_scale)
    torch.testing.assert_close(layer(x), F.linear(x, deq, layer.bias), rtol=1e-5, atol=1e-5)
    assert rel_err(layer(x), F.linear(x, w, layer.bias)) < 0.01  # vs the unquantized layer


@pytest.mark.parametrize("shape", [(1, 96), (8, 96), (2, 3, 96)])
def test_int8_wo_cpu_bf16_path_matches_dequantized(shape: tuple[int, ...]) -> None:
    """Up to _CPU_PACKED_MAX_M rows the CPU runs torch's INT8 GEMM in bf16: equal to the
    dequantized product of bf16-rounded x and scales within the bf16 rounding of the output
    (2**-8 relative), and within 1% of the float32 dequantized reference."""
    if not int8_wo._HAS_INT8PACK_MM:
        pytest.skip("this torch has no _weight_int8pack_mm")
    q, s = utils.quantize_int8_per_channel(torch.randn(200, 96))
    x, bias = torch.randn(shape), torch.randn(200)
    got = int8_wo.int8_linear(x, q, s, bias)
    assert got.dtype == torch.float32 and got.shape == (*shape[:-1], 200)
    bf16 = F.linear(x.bfloat16().float(), q.float()) * s.bfloat16().float()
    torch.testing.assert_close(got - bias, bf16, rtol=2 ** -8, atol=1e-3)
    exact = F.linear(x, utils.dequantize_per_channel(q, s), bias)
    assert 1e-4 < rel_err(got, exact) < 0.01  # the bf16 path ran, not the exact conversion


def test_int8_wo_cpu_without_int8pack_converts(monkeypatch) -> None:
    monkeypatch.setattr(int8_wo, "_HAS_INT8PACK_MM", False)
    q, s = utils.quantize_int8_per_channel(torch.randn(40, 32))
    x = torch.randn(2, 32)
    torch.testing.assert_close(int8_wo.int8_linear(x, q, s, None),
                               F.linear(x, utils.dequantize_per_channel(q, s)),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_apply_matches_dequantized(fused: bool) -> None:
    layer, w = _layer("fp8", fused)
    assert layer.weight.dtype == utils.FP8_DTYPE
    x = torch.randn(5, 64)
    # W8A8: the oracle quantizes x per token too.
    xq, sx = utils.quantize_per_token(x, utils.FP8_DTYPE)
    deq = utils.dequantize_per_channel(layer.weight, layer.weight_scale)
    want = F.linear(xq.float() * sx, deq, layer.bias)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fp8_linear_reference(x, layer.weight, layer.weight_scale),
                               want - layer.bias, rtol=1e-5, atol=1e-5)
    assert rel_err(layer(x), F.linear(x, w, layer.bias)) < 0.06


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 512])
def test_gpu_fp8_gated_down_projection(m: int) -> None:
    """apply_gated (the fused SiLU-and-quantize kernel above 16 rows, the gated GEMV below)
    equals apply(silu_and_mul(gate_up)), the unfused path."""
    from slipstream.kernels import get_ops
    from slipstream.layers.activation import SiluAndMul
    from slipstream.layers.linear import RowParallelLinear

    skip_without_fp8()
    with torch.device("cuda"):
        layer = RowParallelLinear(1024, 256, bias=False, params_dtype=torch.bfloat16,
                                  quant_method=get_quant_method_factory("fp8", {})("down"))
    layer.weight.data.normal_()
    layer.quant_method.process_after_loading(layer)
    act = SiluAndMul(get_ops("cuda"))
    gate_up = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
    got = layer.forward_gated(gate_up, act)
    want = layer(act(gate_up))
    if m > 16:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:  # the gated GEMV keeps activations in bf16 (W8A16 at decode sizes)
        assert rel_err(got.float(), want.float()) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 512])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gpu_fp8_normed_projection(m: int, with_residual: bool) -> None:
    """forward_normed (above 16 rows: residual add, RMSNorm and per-token quantization in one
    kernel) equals the norm module then the layer: the new residual bit for bit, the output up
    to the few activations whose FP8 code the fused kernel's division rounds one step apart
    (H200: 438 of 393,216 outputs touched at m=512)."""
    from slipstream.kernels import get_ops
    from slipstream.layers.norm import RMSNorm

    skip_without_fp8()
    with torch.device("cuda"):
        layer = QKVParallelLinear(1024, 64, 8, 2, bias=False, params_dtype=torch.bfloat16,
                                  quant_method=get_quant_method_factory("fp8", {})("qkv"))
        norm = RMSNorm(1024, 1e-5, torch.bfloat16, get_ops("cuda"))
    layer.weight.data.normal_()
    layer.quant_method.process_after_loading(layer)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x) if with_residual else None
    if with_residual:
        h, want_res = norm(x.clone(), residual.clone())
    else:
        h, want_res = norm(x), x
    want = layer(h)
    got, got_res = layer.forward_normed(x, residual, norm)
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)
    assert (got != want).float().mean().item() < 0.01
    assert rel_err(got.float(), want.float()) < 2e-3


def test_unknown_and_mismatched_methods_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown quantization method"):
        get_quant_method_factory("int3_magic", {})
    hf = {"quantization_config": {"quant_method": "fp8"}}
    with pytest.raises(ValueError, match="already quantized with 'fp8'"):
        get_quant_method_factory("int8_wo", hf)
    with pytest.raises(ValueError, match="not supported"):
        utils.detect_quant_method({"quantization_config": {"quant_method": "bitsandbytes"}})
    assert utils.detect_quant_method({"quantization_config": {"quant_method": "awq"}}) == "int4_awq"
    assert utils.detect_quant_method({}) is None


@pytest.mark.parametrize("quantize", ["int8", "fp8", "int4"])
def test_row_chunked_quantization_equals_whole(monkeypatch, quantize) -> None:
    """Large layers are quantized a few rows at a time (bounded float32 temporaries): the same
    codes and scales as one pass over the whole matrix, a partial last chunk included."""
    from slipstream.quantization import utils as qu

    fn = {"int8": qu.quantize_int8_per_channel, "fp8": qu.quantize_fp8_per_channel,
          "int4": lambda w: qu.quantize_int4_groupwise(w, 32)}[quantize]
    w = (torch.randn(37, 96) * torch.logspace(-3, 1, 37)[:, None]).to(torch.bfloat16)
    whole = fn(w)
    monkeypatch.setattr(qu, "ROW_CHUNK_ELEMENTS", 96 * 5)  # 5 rows per chunk: 8 chunks
    chunked = fn(w)
    for a, b in zip(whole, chunked, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.dtype == qu.FP8_DTYPE else a,
                           b.view(torch.uint8) if b.dtype == qu.FP8_DTYPE else b)
