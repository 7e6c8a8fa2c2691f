"""Triton paged attention on mixed prefill/decode batches against the reference twin.

Interpreter runs use float32 (tl.dot is exact there); GPU runs use bf16 over contexts up to 8k.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from slipstream.bench.attn_batch import make_batch
from slipstream.kernels import reference
from slipstream.kernels.attention.paged import AttnConfig, choose_config, paged_attention

pytestmark = pytest.mark.usefixtures("poison_outputs")
ATOL, RTOL = 2e-5, 2e-5  # float32 online softmax vs float32 two-pass softmax

# query_lens / seq_lens: decode tokens (1 / n), a prefill chunk over a cached prefix (7 / 30),
# a first chunk with no prefix (20 / 20), a long-ish decode that spans several tiles.
MIXED = ([1, 7, 1, 20, 3], [1, 30, 45, 20, 70])


def _check(q, kc, vc, meta, cfg=None, scale=0.125) -> None:
    want = reference.paged_attention(q, kc, vc, meta, scale)
    got = paged_attention(q, kc, vc, meta, scale, config=cfg)
    real = meta.query_start_loc_cpu[-1]  # rows past the last sequence are padding
    torch.testing.assert_close(got[:real], want[:real], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("group,head_dim,block_size", [
    (1, 64, 16), (4, 128, 32), (8, 64, 16), (4, 64, 32),
])
def test_mixed_batch(group: int, head_dim: int, block_size: int) -> None:
    q, kc, vc, meta = make_batch(*MIXED, num_kv_heads=2, group=group, head_dim=head_dim,
                                 block_size=block_size, dtype=torch.float32, seed=group)
    _check(q, kc, vc, meta)


@pytest.mark.parametrize("cfg", [
    AttnConfig(block_m=16, block_n=16, num_splits=1, num_warps=4, num_stages=1),
    AttnConfig(block_m=32, block_n=16, num_splits=3, num_warps=4, num_stages=1),
    AttnConfig(block_m=64, block_n=32, num_splits=2, num_warps=4, num_stages=1),
    # More splits than the merge takes per iteration (8), several of them empty.
    AttnConfig(block_m=16, block_n=16, num_splits=11, num_warps=4, num_stages=1),
])
def test_mixed_batch_tilings_and_splits(cfg: AttnConfig) -> None:
    """Several tiles per sequence, tiles smaller than a page, KV split across programs."""
    q, kc, vc, meta = make_batch(*MIXED, num_kv_heads=2, group=4, head_dim=64, block_size=32,
                                 dtype=torch.float32, seed=7)
    _check(q, kc, vc, meta, cfg)


@pytest.mark.parametrize("cfg", [
    AttnConfig(16, 16, 6, 4, 1),
    AttnConfig(16, 16, 6, 4, 2, short_chain=2),  # short splits plain, long ones staged
    AttnConfig(16, 16, 64, 4, 2, short_chain=1),  # a tile a split, many splits empty
    AttnConfig(16, 16, 1, 4, 2, short_chain=2),  # inert without splits (chains of many tiles)
], ids=["plain", "short-chain-2", "short-chain-1", "short-chain-no-split"])
def test_split_tile_loops(cfg: AttnConfig) -> None:
    """The staged two loops and the one-stage loop for short splits (the staged loops for
    longer ones): the same attention on mixed and decode-only batches, every arrival counter
    back at zero."""
    from slipstream.kernels.attention import paged as pa

    q, kc, vc, meta = make_batch(*MIXED, num_kv_heads=2, group=4, head_dim=64, block_size=32,
                                 dtype=torch.float32, seed=8)
    _check(q, kc, vc, meta, cfg)
    q, kc, vc, meta = make_batch([1, 1, 1], [300, 5, 140], num_kv_heads=2, group=4,
                                 head_dim=64, block_size=16, dtype=torch.float32, seed=9)
    _check(q, kc, vc, meta, cfg)
    assert int(pa._COUNTERS[("cpu", None)].abs().sum()) == 0


def test_split_decode_defaults() -> None:
    """Split decode launches give splits of at most _SHORT_CHAIN_TILES tiles the one-stage loop
    and read the first tile before the PDL wait (preload); prefill chunks and unsplit decode
    take neither. The staged loops (short_chain 0) and other chain lengths give the same
    result."""
    from slipstream.kernels.attention import paged as pa

    q, kc, vc, meta = make_batch([1], [300], num_kv_heads=2, group=4, head_dim=64,
                                 block_size=16, dtype=torch.float32, seed=6)
    default = pa.choose_config(meta, 2, 4, 64, q.device, q.dtype)
    assert default.num_splits > 1 and default.short_chain == pa._SHORT_CHAIN_TILES == 2
    assert default.preload
    for chain in (0, 3):
        _check(q, kc, vc, meta, dataclasses.replace(default, short_chain=chain))
    prefill = make_batch([40], [300], num_kv_heads=2, group=4, head_dim=64, block_size=16,
                         dtype=torch.float32, seed=6)[3]
    cfg = pa.choose_config(prefill, 2, 4, 64, q.device, q.dtype)
    assert cfg.short_chain == 0 and not cfg.preload
    wide = make_batch([1] * 64, [40] * 64, num_kv_heads=8, group=4, head_dim=64, block_size=16,
                      dtype=torch.float32, seed=6)[3]
    cfg = pa.choose_config(wide, 8, 4, 64, q.device, q.dtype)
    assert cfg.num_splits == 1 and cfg.short_chain == 0 and not cfg.preload


def test_split_decode_one_stage() -> None:
    """Split decode with one-stage loops (an explicit config): the result unchanged. The
    automatic choice keeps prefill's two stages."""
    from slipstream.kernels.attention import paged as pa

    q, kc, vc, meta = make_batch([1], [300], num_kv_heads=2, group=4, head_dim=64,
                                 block_size=16, dtype=torch.float32, seed=6)
    prefill = make_batch([40], [300], num_kv_heads=2, group=4, head_dim=64, block_size=16,
                         dtype=torch.bfloat16, seed=6)[3]
    assert pa.choose_config(prefill, 2, 4, 64, q.device, torch.bfloat16).num_stages == 2
    cfg = pa.choose_config(meta, 2, 4, 64, q.device, q.dtype)
    assert cfg.num_splits > 1
    _check(q, kc, vc, meta, dataclasses.replace(cfg, num_stages=1))


def test_decode_only_auto_splits() -> None:
    """Pure decode with long-ish contexts: the automatic choice splits the KV range."""
    q, kc, vc, meta = make_batch([1, 1, 1], [300, 5, 140], num_kv_heads=1, group=4,
                                 head_dim=64, block_size=16, dtype=torch.float32, seed=3)
    _check(q, kc, vc, meta)
    # The merging program resets its tile's arrival counter: a replay starts from zero.
    from slipstream.kernels.attention import paged as pa

    _check(q, kc, vc, meta, AttnConfig(16, 16, 5, 4, 1))
    assert int(pa._COUNTERS[("cpu", None)].abs().sum()) == 0


def test_longer_splits(monkeypatch) -> None:
    """_MIN_TOKENS_PER_SPLIT (the module constant): longer splits give fewer of them for a
    short decode, none once one covers the context; the result unchanged."""
    from slipstream.kernels.attention import paged as pa

    q, kc, vc, meta = make_batch([1], [300], num_kv_heads=2, group=4, head_dim=64,
                                 block_size=16, dtype=torch.float32, seed=5)
    splits = {}
    for tokens in (64, 128, 512):
        monkeypatch.setattr(pa, "_MIN_TOKENS_PER_SPLIT", tokens)
        splits[tokens] = pa.choose_config(meta, 2, 4, 64, q.device, q.dtype).num_splits
        _check(q, kc, vc, meta)
    assert splits[64] >= splits[128] > splits[512] == 1  # (64: also capped by the SM count)


def test_split_tile_and_warps() -> None:
    """Split decode launches take _SPLIT_WARPS (8) warps, prefill does not; a shorter tile and
    fewer warps (an explicit config) give the same result."""
    from slipstream.kernels.attention import paged as pa

    q, kc, vc, meta = make_batch([1], [300], num_kv_heads=2, group=4, head_dim=64,
                                 block_size=16, dtype=torch.float32, seed=6)
    default = pa.choose_config(meta, 2, 4, 64, q.device, q.dtype)
    assert default.num_splits > 1 and default.num_warps == pa._SPLIT_WARPS == 8
    _check(q, kc, vc, meta, dataclasses.replace(default, block_n=16, num_warps=2))
    prefill = make_batch([40], [300], num_kv_heads=2, group=4, head_dim=64, block_size=16,
                         dtype=torch.float32, seed=6)[3]
    assert pa.choose_config(prefill, 2, 4, 64, q.device, q.dtype).num_warps != 8  # decode only


def test_causal_boundary_sweep() -> None:
    """Prefix lengths around a tile edge: the unmasked/masked tile split must be exact."""
    ctx = list(range(11, 20))
    q, kc, vc, meta = make_batch([3] * len(ctx), [3 + c for c in ctx], num_kv_heads=1, group=1,
                                 head_dim=64, block_size=16, dtype=torch.float32, seed=11)
    _check(q, kc, vc, meta, AttnConfig(16, 16, 1, 4, 1))


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # merge reads padding rows
def test_padding_rows_and_empty_sequence() -> None:
    """CUDA-graph style padding rows and a sequence with no query tokens this step."""
    q, kc, vc, meta = make_batch([2, 0, 1], [9, 4, 33], num_kv_heads=2, group=2, head_dim=64,
                                 block_size=16, dtype=torch.float32, pad_tokens=3, seed=5)
    _check(q, kc, vc, meta, AttnConfig(16, 16, 2, 4, 1))


@pytest.mark.filterwarnings("ignore:All-NaN slice")
def test_decode_padding_rows_and_empty_sequence() -> None:
    """Decode batches index sequences by program id (no search): padding rows after the last
    sequence and a sequence without a query token this step must still come out right."""
    q, kc, vc, meta = make_batch([1, 0, 1, 1], [9, 4, 33, 70], num_kv_heads=2, group=4,
                                 head_dim=64, block_size=16, dtype=torch.float32, pad_tokens=4,
                                 seed=9)
    assert meta.max_query_len == 1
    _check(q, kc, vc, meta, AttnConfig(16, 16, 1, 4, 1))
    _check(q, kc, vc, meta, AttnConfig(16, 16, 3, 4, 1))
    _check(q, kc, vc, meta, AttnConfig(16, 16, 1, 4, 1, heads_first=True))


def test_heads_first_grid_only_in_decode() -> None:
    """heads_first swaps the grid's sequence and KV-head axes in decode launches without
    splits; a mixed batch or a split launch ignores it and stays exact."""
    q, kc, vc, meta = make_batch([1] * 5, [3, 17, 40, 64, 90], num_kv_heads=4, group=2,
                                 head_dim=32, block_size=16, dtype=torch.float32, seed=4)
    _check(q, kc, vc, meta, AttnConfig(16, 16, 1, 4, 1, heads_first=True))
    _check(q, kc, vc, meta, AttnConfig(16, 16, 3, 4, 1, heads_first=True))
    _check(*make_batch(*MIXED, num_kv_heads=2, group=4, head_dim=32, block_size=16,
                       dtype=torch.float32), AttnConfig(16, 16, 1, 4, 1, heads_first=True))


def test_strided_q_view() -> None:
    """q as a slice of the fused QKV output (row stride wider than Hq * D)."""
    q, kc, vc, meta = make_batch([3, 1], [10, 17], num_kv_heads=2, group=2, head_dim=64,
                                 block_size=16, dtype=torch.float32, seed=9)
    wide = torch.randn(q.shape[0], q.shape[1] + 3, q.shape[2])
    wide[:, : q.shape[1]] = q
    _check(wide[:, : q.shape[1]], kc, vc, meta)


# ------------------------------------------------------- fp8 / int8 caches (interpreter)
QUANT_DTYPES = [torch.float8_e4m3fn, torch.int8]


def _quantize_caches(kc: torch.Tensor, vc: torch.Tensor, dtype: torch.dtype):
    """The random caches stored as `dtype` with per-tensor scales from their amax (K scaled up
    first, so scores are not all near zero)."""
    qmax = reference.KV_QMAX[dtype]
    kc = kc.float() * 3
    ks = (kc.abs().amax() / qmax).float()
    vs = (vc.float().abs().amax() / qmax).float()
    return (reference.quantize_kv(kc, dtype, ks), reference.quantize_kv(vc.float(), dtype, vs),
            ks, vs)


def _check_quant(q, kc, vc, ks, vs, meta, cfg=None, scale=0.125) -> None:
    want = reference.paged_attention(q, kc, vc, meta, scale, k_scale=ks, v_scale=vs)
    got = paged_attention(q, kc, vc, meta, scale, k_scale=ks, v_scale=vs, config=cfg)
    real = meta.query_start_loc_cpu[-1]
    # The same dequantized operands: float32 rounding only (k_scale folded into the score
    # scale, v_scale applied after the softmax division).
    torch.testing.assert_close(got[:real], want[:real], atol=ATOL, rtol=RTOL)


# Smaller than MIXED (the interpreter is slow): decodes, a chunk over a prefix, a fresh prefill.
QMIXED = ([1, 6, 1, 9], [1, 22, 45, 9])
SPLIT3 = AttnConfig(block_m=32, block_n=16, num_splits=3, num_warps=4, num_stages=1)


@pytest.mark.parametrize("dtype,group,head_dim,cfg", [
    (torch.float8_e4m3fn, 1, 64, None), (torch.int8, 1, 64, None),
    (torch.float8_e4m3fn, 4, 64, SPLIT3), (torch.int8, 4, 64, SPLIT3),
    (torch.float8_e4m3fn, 8, 128, SPLIT3), (torch.int8, 8, 128, None),
])
def test_mixed_batch_quantized_cache(dtype: torch.dtype, group: int, head_dim: int,
                                     cfg: AttnConfig | None) -> None:
    """Prefill chunks and decodes, GQA, split-KV over fp8 / int8 caches."""
    q, kc, vc, meta = make_batch(*QMIXED, num_kv_heads=2, group=group, head_dim=head_dim,
                                 block_size=16, dtype=torch.float32, seed=group)
    kq, vq, ks, vs = _quantize_caches(kc, vc, dtype)
    _check_quant(q, kq, vq, ks, vs, meta, cfg)


@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_quantized_cache_scales_are_applied(dtype: torch.dtype) -> None:
    """Doubling k_scale sharpens the softmax and doubling v_scale doubles the output, in both
    implementations: the kernel must read the scales, not assume 1.0."""
    q, kc, vc, meta = make_batch([1, 4], [40, 9], num_kv_heads=1, group=2, head_dim=64,
                                 block_size=16, dtype=torch.float32, seed=2)
    kq, vq, ks, vs = _quantize_caches(kc, vc, dtype)
    base = paged_attention(q, kq, vq, meta, 0.125, k_scale=ks, v_scale=vs)
    _check_quant(q, kq, vq, ks * 2, vs, meta)
    doubled_v = paged_attention(q, kq, vq, meta, 0.125, k_scale=ks, v_scale=vs * 2)
    torch.testing.assert_close(doubled_v, base * 2, atol=ATOL, rtol=RTOL)
    sharper = paged_attention(q, kq, vq, meta, 0.125, k_scale=ks * 2, v_scale=vs)
    assert (sharper - base).abs().max() > 1e-3


# ---------------------------------------------------------------------------- GPU (bf16)
def _gpu_case(query_lens, seq_lens, group, head_dim, block_size, num_kv_heads=8,
              cfg=None) -> None:
    q, kc, vc, meta = make_batch(query_lens, seq_lens, num_kv_heads=num_kv_heads, group=group,
                                 head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16,
                                 device="cuda", seed=len(seq_lens))
    scale = head_dim ** -0.5
    want = reference.paged_attention(q, kc, vc, meta, scale).float()
    got = paged_attention(q, kc, vc, meta, scale, config=cfg).float()
    assert torch.isfinite(got).all()
    # bf16 P @ V (probabilities rounded to bf16) vs a float32 softmax: ~3 significant digits.
    rel = (got - want).norm() / want.norm()
    assert rel < 1e-2, f"relative error {rel:.2e}"
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gpu_mixed_batch_bf16(group: int, head_dim: int, block_size: int) -> None:
    # Decode tokens at contexts 1 .. 8k, a chunk over a cached prefix and a fresh prefill.
    _gpu_case([1, 1, 1, 1, 1, 256, 512], [1, 17, 1000, 4096, 8192, 3000, 512], group, head_dim,
              block_size)


@pytest.mark.gpu
@pytest.mark.parametrize("context", [1, 100, 1024, 4097, 8192])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_gpu_decode_bf16(context: int, batch: int) -> None:
    """Pure decode (the flash-decoding split path at small batch)."""
    lens = [max(1, context - 13 * i) for i in range(batch)]
    _gpu_case([1] * batch, lens, 4, 128, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("loop", ["plain", "short-chain"])
@pytest.mark.parametrize("context", [100, 256, 1024, 4097])
@pytest.mark.parametrize("batch", [1, 7])
def test_gpu_split_decode_tile_loops(loop: str, context: int, batch: int) -> None:
    """The tile loops of split decode at batch-1 W1's launch shape (8 KV heads x 33 splits:
    a tile a split up to ~2k tokens, several beyond), bf16."""
    lens = [max(1, context - 13 * i) for i in range(batch)]
    cfg = AttnConfig(16, 64, 33, 8, 3, short_chain=2 if loop == "short-chain" else 0)
    _gpu_case([1] * batch, lens, 4, 128, 16, cfg=cfg)


@pytest.mark.gpu
def test_gpu_decode_heads_first() -> None:
    """The heads-first grid at a many-sequence decode batch (no splits), bf16."""
    lens = [1 + (37 * i) % 1500 for i in range(300)]
    q, kc, vc, meta = make_batch([1] * 300, lens, num_kv_heads=8, group=4, head_dim=128,
                                 block_size=16, dtype=torch.bfloat16, device="cuda")
    cfg = choose_config(meta, 8, 4, 128, q.device)
    assert cfg.num_splits == 1
    _gpu_case([1] * 300, lens, 4, 128, 16, cfg=dataclasses.replace(cfg, heads_first=True))


@pytest.mark.gpu
def test_gpu_long_prefill_chunk_bf16() -> None:
    _gpu_case([2048, 1], [8192, 8192], 4, 128, 16)


@pytest.mark.gpu
def test_gpu_float32_exact_path() -> None:
    """float32 (the engine's exact GPU mode) uses IEEE products: near float32 rounding."""
    q, kc, vc, meta = make_batch([1, 37, 1], [1, 300, 2000], num_kv_heads=2, group=4,
                                 head_dim=128, block_size=16, dtype=torch.float32, device="cuda")
    torch.testing.assert_close(paged_attention(q, kc, vc, meta, 0.08),
                               reference.paged_attention(q, kc, vc, meta, 0.08),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_decode_graph_replay_with_new_lengths() -> None:
    """Captured once (split count fixed by the max_seq_len bound), replayed on new lengths."""
    lens = [4096, 4096, 4096, 4096]
    q, kc, vc, meta = make_batch([1] * 4, lens, num_kv_heads=8, group=4, head_dim=128,
                                 block_size=16, dtype=torch.bfloat16, device="cuda")
    paged_attention(q, kc, vc, meta, 0.1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(q, kc, vc, meta, 0.1)
    for new_lens in ([1000, 17, 4096, 3], [1, 4000, 129, 2048]):
        meta.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        graph.replay()
        now = type(meta)(**{**meta.__dict__, "seq_lens_cpu": new_lens,
                            "max_seq_len": max(new_lens)})
        want = reference.paged_attention(q, kc, vc, now, 0.1).float()
        assert (out.float() - want).norm() / want.norm() < 1e-2


def _gpu_quant_case(dtype, query_lens, seq_lens, group, head_dim, block_size=16,
                    num_kv_heads=8) -> None:
    q, kc, vc, meta = make_batch(query_lens, seq_lens, num_kv_heads=num_kv_heads, group=group,
                                 head_dim=head_dim, block_size=block_size, dtype=torch.bfloat16,
                                 device="cuda", seed=len(seq_lens))
    kq, vq, ks, vs = _quantize_caches(kc, vc, dtype)
    scale = head_dim ** -0.5
    want = reference.paged_attention(q, kq, vq, meta, scale, k_scale=ks, v_scale=vs).float()
    got = paged_attention(q, kq, vq, meta, scale, k_scale=ks, v_scale=vs).float()
    assert torch.isfinite(got).all()
    # Same bound as the bf16 cache: the fp8 / int8 values are exact in bf16, so only the bf16
    # P @ V rounding separates the kernel from the float32 reference.
    rel = (got - want).norm() / want.norm()
    assert rel < 1e-2, f"relative error {rel:.2e}"
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_mixed_batch_quantized_cache_bf16(dtype, group: int, head_dim: int) -> None:
    # Decode tokens at contexts 1 .. 4k, a chunk over a cached prefix and a fresh prefill.
    _gpu_quant_case(dtype, [1, 1, 1, 1, 256, 512], [1, 17, 1000, 4096, 3000, 512], group,
                    head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("context", [100, 1024, 4096])
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_decode_quantized_cache_bf16(dtype, context: int, batch: int) -> None:
    """Pure decode: the flash-decoding split path at small batch."""
    lens = [max(1, context - 13 * i) for i in range(batch)]
    _gpu_quant_case(dtype, [1] * batch, lens, 4, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_gpu_quantized_cache_graph_replay_reads_new_scales(dtype) -> None:
    """Scales are read on the device: a captured graph sees scale changes made after capture."""
    q, kc, vc, meta = make_batch([1] * 4, [4096, 1000, 17, 2048], num_kv_heads=8, group=4,
                                 head_dim=128, block_size=16, dtype=torch.bfloat16,
                                 device="cuda")
    kq, vq, ks, vs = _quantize_caches(kc, vc, dtype)
    ks, vs = ks.clone(), vs.clone()
    paged_attention(q, kq, vq, meta, 0.1, k_scale=ks, v_scale=vs)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(q, kq, vq, meta, 0.1, k_scale=ks, v_scale=vs)
    ks.mul_(1.5)
    vs.mul_(0.5)
    graph.replay()
    want = reference.paged_attention(q, kq, vq, meta, 0.1, k_scale=ks, v_scale=vs).float()
    assert (out.float() - want).norm() / want.norm() < 1e-2
