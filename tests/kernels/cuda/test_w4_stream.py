"""The register-streaming CUDA C++ one-row int4 GEMV (kernels/cuda/w4_stream.cu).

CPU: its configs (which K each splits, what the default picks) and its switch (on by default). GPU: every
variant and config against the float reference and the split-int8 twin, eager and replayed in
a CUDA graph, and the switch serving int4_awq's one-row calls (down's K 14336 included)."""
from __future__ import annotations

import functools

import pytest
import torch

from slipstream import envs
from slipstream.kernels.cuda.w4_stream import (
    StreamConfig,
    config_ok,
    default_config,
    maybe_stream,
    shared_bytes,
    supported,
    w4_gemv_stream,
    w4_split_int8_reference,
)
from slipstream.kernels.gemv.int4_common import w4_linear_reference
from slipstream.kernels.reference import silu_and_mul
from tests.kernels.gemv.gemv_helpers import (
    fused_variant,
    quantized,
    rel,
    replayed_in_a_graph,
    rms_normed,
)


def test_config_parse_and_split_rules() -> None:
    assert StreamConfig.parse("8:4:2:2") == StreamConfig(8, 4, 2, 2)
    assert config_ok(StreamConfig(8, 1, 4), 4096)       # 32 groups a warp, 4 at a time
    assert config_ok(StreamConfig(8, 8, 2), 14336)      # 112 groups: 14 a warp
    assert not config_ok(StreamConfig(8, 8, 4), 14336)  # 14 is not a multiple of 4
    assert not config_ok(StreamConfig(8, 3, 1), 4096)   # warps a tile must divide the block
    assert not config_ok(StreamConfig(32, 2, 1), 4096)  # 16 shared tiles: 15 named barriers
    assert config_ok(StreamConfig(16, 1, 1), 4096)      # unshared tiles need none
    assert supported(4096, 14336, 128) and not supported(4096, 4096, 64)
    assert not supported(4104, 4096, 128)               # 16-row tiles


def test_default_config_splits_each_tile_over_eight_warps() -> None:
    sms = 132
    # Llama-3.1-8B's shapes: 16 warps a block, two tiles, two groups in flight, in registers
    for n, k in [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]:
        cfg = default_config(n, k, False, sms)
        assert cfg == StreamConfig(16, 8, 2, 1) and config_ok(cfg, k)
    # fewer groups than 8 a row: fewer warps a tile; an odd share: one group a chunk
    assert default_config(16, 128 * 4, False, sms).ksplit == 4
    assert default_config(16, 128 * 7, False, sms) == StreamConfig(16, 1, 1, 1)
    assert config_ok(default_config(16, 128 * 7, False, sms), 128 * 7)


def test_shared_memory_is_small() -> None:
    # x's split is K / 2 bytes: blocks leave room for the kernels around them
    assert shared_bytes(4096, 8) < 10 * 1024
    assert shared_bytes(14336, 8) < 32 * 1024


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("0", False)])
def test_switch_is_on_unless_set_to_zero(monkeypatch, value, on) -> None:
    """envs.CUDA_GEMV, read at each call (maybe_stream)."""
    monkeypatch.delenv("SLIPSTREAM_CUDA_GEMV", raising=False)
    if value is not None:
        monkeypatch.setenv("SLIPSTREAM_CUDA_GEMV", value)
    assert envs.CUDA_GEMV.get() is on


def test_maybe_stream_leaves_cpu_and_unsupported_calls_to_triton(monkeypatch) -> None:
    monkeypatch.setenv("SLIPSTREAM_CUDA_GEMV", "1")
    q, s, z = quantized(64, 1024, 128)
    x = torch.randn(1, 1024).bfloat16()
    assert maybe_stream(x, q, s, z, 128, None) is None  # CUDA only: the caller's path runs
    monkeypatch.setenv("SLIPSTREAM_CUDA_GEMV", "0")
    assert maybe_stream(x, q, s, z, 128, None) is None


def test_bad_input_is_refused_with_a_reason() -> None:
    q, s, z = quantized(64, 1024, 128)
    with pytest.raises(ValueError, match="one bf16 row"):
        w4_gemv_stream(torch.randn(2, 1024).bfloat16(), q, s, z)
    with pytest.raises(ValueError, match="does not split"):
        w4_gemv_stream(torch.randn(1, 1024).bfloat16(), q, s, z, config=StreamConfig(8, 3, 1))
    with pytest.raises(ValueError, match="uint8 zero points only"):
        w4_gemv_stream(torch.randn(1, 1024).bfloat16(), q, s, z.half())


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,spec", [
    (4096, 4096, "8:1:2:2"), (4096, 4096, "8:1:4:2"), (6144, 4096, "8:4:2:2"),
    (4096, 4096, "8:8:2:2"), (4096, 14336, "8:8:2:2"), (4096, 14336, "8:4:7:1"),
    (1024, 2048, "4:2:2:4"), (48, 1024, "8:1:8:2"), (4096, 4096, "8:8:4:2"),
    (6144, 4096, "16:16:2:1"), (4096, 4096, "16:8:2:1"),
])
def test_stream_gemv_matches_the_reference(n, k, spec) -> None:
    q, s, z = quantized(n, k, 128, device="cuda", seed=n + k)
    x = torch.randn(1, k, device="cuda").bfloat16()
    got = w4_gemv_stream(x, q, s, z, config=StreamConfig.parse(spec))
    want = w4_linear_reference(x, q, s, z, 128)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert rel(got, want) < 4e-3
    assert rel(got, w4_split_int8_reference(x, q, s, z)) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("spec", ["8:1:2:2", "8:4:2:2"])
@pytest.mark.parametrize("bias,rms_eps,gate_out", [
    (True, 0.0, False), (False, 1e-5, False), (False, 0.0, True), (True, 1e-5, True),
])
def test_stream_gemv_fused_variants(bias, rms_eps, gate_out, spec) -> None:
    run = functools.partial(w4_gemv_stream, config=StreamConfig.parse(spec))
    got, want = fused_variant(run, bias, rms_eps, gate_out)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert rel(got, want) < 6e-3


@pytest.mark.gpu
def test_stream_gemv_in_a_cuda_graph() -> None:
    out, want = replayed_in_a_graph(w4_gemv_stream, 4096, 14336)
    assert rel(out, want) < 4e-3


@pytest.mark.gpu
def test_maybe_stream_serves_the_one_row_calls(monkeypatch) -> None:
    from slipstream.kernels.gemv import int4 as gemv_int4

    monkeypatch.setenv("SLIPSTREAM_CUDA_GEMV", "1")
    q, s, z = quantized(1024, 4096, 128, device="cuda", seed=5)
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    want = w4_linear_reference(x, q, s, z, 128)
    assert rel(gemv_int4.w4_linear_small(x, q, s, z, 128), want) < 4e-3
    got = gemv_int4.w4_linear_small_rms(x, q, s, z, 128, None, 1e-5)
    assert rel(got, w4_linear_reference(rms_normed(x, 1e-5), q, s, z, 128)) < 4e-3
    gate = gemv_int4.w4_linear_small_gate_out(x, q, s, z, 128)
    assert rel(gate, silu_and_mul(want.float().bfloat16().float())) < 6e-3
    # the down projection's K runs here too; two rows keep the Triton path
    qd, sd, zd = quantized(64, 14336, 128, device="cuda")
    xd = torch.randn(1, 14336, device="cuda").bfloat16()
    assert rel(maybe_stream(xd, qd, sd, zd, 128, None),
               w4_linear_reference(xd, qd, sd, zd, 128)) < 4e-3
    assert maybe_stream(torch.randn(2, 4096, device="cuda").bfloat16(), q, s, z, 128,
                        None) is None
