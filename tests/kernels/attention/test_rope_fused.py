"""Decode attention with RoPE and the KV-cache write inside the kernel (paged_attention's rope=)
against the two-step path: rotary_and_cache_write, then paged_attention. CPU: Triton's
interpreter in float32 against the reference ops; GPU: bit-equal to the two Triton kernels."""
from __future__ import annotations

import pytest
import torch

from slipstream.bench.attn_batch import make_batch
from slipstream.kernels import reference
from slipstream.kernels.attention.paged import AttnConfig, RopeInput, paged_attention

pytestmark = pytest.mark.usefixtures("poison_outputs")


def _cos_sin(max_pos: int, head_dim: int) -> torch.Tensor:
    inv = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


def _decode_case(lens: list[int], group: int, head_dim: int, dtype: torch.dtype,
                 cache_dtype: torch.dtype | None = None, device: str = "cpu", pad: int = 0):
    """A decode batch: raw q, the new tokens' k / v, positions, cos/sin, caches and metadata."""
    hkv = 2
    q, kc, vc, meta = make_batch([1] * len(lens), lens, num_kv_heads=hkv, group=group,
                                 head_dim=head_dim, block_size=16, dtype=dtype, device=device,
                                 pad_tokens=pad)
    gen = torch.Generator(device=device).manual_seed(1)
    k = torch.randn((q.shape[0], hkv, head_dim), generator=gen, device=device).to(dtype)
    v = torch.randn((q.shape[0], hkv, head_dim), generator=gen, device=device).to(dtype)
    positions = torch.tensor([n - 1 for n in lens] + [0] * pad, device=device)
    scales = {}
    if cache_dtype is not None:
        kc, vc = (kc.float() / 4).to(cache_dtype), (vc.float() / 4).to(cache_dtype)
        scales = {"k_scale": torch.tensor(0.5, device=device),
                  "v_scale": torch.tensor(0.25, device=device)}
    return q, k, v, positions, _cos_sin(max(lens) + 1, head_dim).to(device), kc, vc, meta, scales


def _two_step(ops, q, k, v, positions, cos_sin, kc, vc, meta, scales, **kw):
    q_rot, _ = ops.rotary_and_cache_write(q, k, v, positions, cos_sin, kc, vc, meta.slot_mapping,
                                          **scales)
    return ops.paged_attention(q_rot, kc, vc, meta, 0.1, **scales, **kw)


def _fused(q, k, v, positions, cos_sin, kc, vc, meta, scales, **kw):
    return paged_attention(q, kc, vc, meta, 0.1, rope=RopeInput(k, v, positions, cos_sin),
                           **scales, **kw)


@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 64), (2, 80)])
@pytest.mark.parametrize("cfg", [None, AttnConfig(16, 32, 1, 4, 1), AttnConfig(16, 32, 3, 4, 1),
                                 # the first tile read before the new token's row is known
                                 AttnConfig(16, 32, 1, 4, 1, preload=True),
                                 AttnConfig(16, 32, 3, 4, 1, preload=True),
                                 AttnConfig(16, 16, 4, 4, 1, preload=True),
                                 AttnConfig(16, 16, 4, 4, 2, preload=True, short_chain=2),
                                 # the one-stage loop of short splits (one tile, two)
                                 AttnConfig(16, 16, 4, 4, 2, short_chain=1),
                                 AttnConfig(16, 16, 2, 4, 2, short_chain=2),
                                 AttnConfig(16, 16, 2, 4, 2, short_chain=1)])
def test_fused_rope_decode_interpreter(group: int, head_dim: int, cfg: AttnConfig | None) -> None:
    case = _decode_case([1, 17, 40, 33], group, head_dim, torch.float32, pad=2)
    q, k, v, positions, cos_sin, kc, vc, meta, scales = case
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = _two_step(reference, q, k, v, positions, cos_sin, kc_ref, vc_ref, meta, scales)
    got = _fused(q, k, v, positions, cos_sin, kc, vc, meta, scales, config=cfg)
    rows = meta.num_tokens - 2  # padding rows are left unwritten by both
    torch.testing.assert_close(kc, kc_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(vc, vc_ref, atol=0, rtol=0)
    torch.testing.assert_close(got[:rows], want[:rows], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("cfg", [None, AttnConfig(16, 32, 2, 4, 1, preload=True),
                                 AttnConfig(16, 16, 3, 4, 2, short_chain=2)])
def test_fused_rope_decode_quantized_cache_interpreter(cache_dtype: torch.dtype,
                                                       cfg: AttnConfig | None) -> None:
    case = _decode_case([5, 70], 2, 64, torch.float32, cache_dtype)
    q, k, v, positions, cos_sin, kc, vc, meta, scales = case
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = _two_step(reference, q, k, v, positions, cos_sin, kc_ref, vc_ref, meta, scales)
    got = _fused(q, k, v, positions, cos_sin, kc, vc, meta, scales, config=cfg)
    assert torch.equal(kc.float(), kc_ref.float()) and torch.equal(vc.float(), vc_ref.float())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_rope_rejects_prefill() -> None:
    q, kc, vc, meta = make_batch([3], [3], num_kv_heads=1, group=1, head_dim=16, block_size=16,
                                 dtype=torch.float32)
    rope = RopeInput(q, q, torch.zeros(3, dtype=torch.int64), _cos_sin(4, 16))
    with pytest.raises(ValueError, match="decode"):
        paged_attention(q, kc, vc, meta, 0.1, rope=rope)


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn])
@pytest.mark.parametrize("lens", [[1], [200], [64, 129, 1000, 4097], [300] * 33])
@pytest.mark.parametrize("cfg", [None, AttnConfig(16, 64, 33, 8, 3),
                                 AttnConfig(16, 64, 33, 8, 3, short_chain=2)],
                         ids=["auto", "plain", "short-chain"])
def test_gpu_fused_rope_decode_bit_equal(cache_dtype, lens: list[int], cfg) -> None:
    """bf16 on the H200: the fused kernel stores the same cache bytes and returns the same
    output bits as the separate rotary + attention kernels (both with cfg; auto: the one-stage
    loop for splits of up to 2 tiles at the split counts)."""
    from slipstream.kernels import triton_ops

    ops = triton_ops.ops()
    case = _decode_case(lens, 4, 128, torch.bfloat16, cache_dtype, device="cuda", pad=3)
    q, k, v, positions, cos_sin, kc, vc, meta, scales = case
    kc_ref, vc_ref = kc.clone(), vc.clone()
    want = _two_step(ops, q, k, v, positions, cos_sin, kc_ref, vc_ref, meta, scales, config=cfg)
    got = _fused(q, k, v, positions, cos_sin, kc, vc, meta, scales, config=cfg)
    rows = meta.num_tokens - 3
    assert torch.equal(kc.view(torch.uint8), kc_ref.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8))
    assert torch.equal(got[:rows], want[:rows])


def _replay_after_qkv_gemv(lens: list[int], attn_kwargs) -> AttnConfig:
    """A QKV GEMV, then the fused decode attention on its q / k / v, captured in a CUDA graph
    (PDL on where the GPU has it): ten replays each equal, in output and cache bytes, one eager
    run. attn_kwargs(cfg, captured) -> paged_attention's keywords for the eager run (False)
    and the captured one (True); cfg is choose_config's. Returns cfg."""
    from slipstream.kernels.attention.paged import choose_config
    from slipstream.kernels.gemv import dense as gemv
    from slipstream.kernels.runtime import pdl

    device = torch.device("cuda")
    if not pdl.enabled(device):
        pytest.skip("needs programmatic dependent launch (compute capability 9.0+)")
    q0, k0, _, positions, cos_sin, kc, vc, meta, scales = _decode_case(
        lens, 4, 128, torch.bfloat16, device="cuda")
    tokens, hq, d = q0.shape
    hkv = k0.shape[1]
    x = torch.randn(tokens, 256, device=device, dtype=torch.bfloat16)
    w = torch.randn((hq + 2 * hkv) * d, 256, device=device, dtype=torch.bfloat16) / 16
    cfg = choose_config(meta, hkv, hq // hkv, d, device)

    def step(captured: bool) -> torch.Tensor:
        qkv = gemv.gemv(x, w)
        q = qkv[:, : hq * d].view(tokens, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
        v = qkv[:, (hq + hkv) * d :].view(tokens, hkv, d)
        return paged_attention(q, kc, vc, meta, 0.1, rope=RopeInput(k, v, positions, cos_sin),
                               **attn_kwargs(cfg, captured), **scales)

    want = step(False).clone()
    kc_want, vc_want = kc.clone(), vc.clone()
    step(True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = step(True)
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)
        assert torch.equal(kc, kc_want) and torch.equal(vc, vc_want)
    return cfg


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[200], [64, 129, 1000]])
def test_gpu_preload_in_graph_after_the_qkv_gemv(lens: list[int]) -> None:
    """PRELOAD under programmatic dependent launch: in a CUDA graph the attention kernel starts
    while the GEMV writing q / k / v still runs, so its early reads must touch none of them.
    The replayed output and cache bytes equal an eager run without it."""
    import dataclasses

    _replay_after_qkv_gemv(
        lens, lambda cfg, captured: {"config": dataclasses.replace(cfg, preload=captured)})


def _weights_table(device: str) -> torch.Tensor:
    """A span table over a few MB of stand-in weights (kernels/attention/l2_spans.py)."""
    from slipstream.kernels.attention.l2_spans import span_table

    w = [torch.randn(1024, 1024, device=device), torch.randn(256, device=device)]
    return span_table([w], 3 << 20, torch.device(device)), w


@pytest.mark.parametrize("cfg", [AttnConfig(16, 16, 4, 4, 2, preload=True, short_chain=2),
                                 AttnConfig(16, 32, 3, 4, 1),
                                 AttnConfig(16, 32, 1, 4, 1)])  # one split: no spare row
@pytest.mark.parametrize("rows", [1, 2])
def test_fused_rope_decode_with_l2_prefetch_rows_interpreter(monkeypatch, cfg: AttnConfig,
                                                            rows: int) -> None:
    """The spare rows of L2-prefetch programs (recording instead of prefetching: the
    interpreter has no PTX) take every span of the table exactly once, and leave every output
    and cache byte as it was; a launch of one split has no spare row."""
    from slipstream.kernels.attention import paged as pa
    from slipstream.kernels.attention.l2_prefetch import RECORD, RECORD_MARK

    monkeypatch.setattr(pa, "_PF_CPU_MODE", RECORD)
    monkeypatch.setattr(pa, "_PF_ROWS", rows)
    table, _ = _weights_table("cpu")
    before = table.clone()
    results = []
    for l2 in (None, table):
        case = _decode_case([1, 17, 40, 33], 4, 64, torch.float32, pad=2)
        q, k, v, positions, cos_sin, kc, vc, meta, scales = case
        got = _fused(q, k, v, positions, cos_sin, kc, vc, meta, scales, config=cfg,
                     l2_prefetch=l2)
        results.append((got[: meta.num_tokens - 2], kc, vc))
    for want, got in zip(results[0], results[1], strict=True):
        assert torch.equal(want, got)
    marks = 0 if cfg.num_splits == 1 else RECORD_MARK
    assert torch.equal(table[:, 0], before[:, 0])
    assert torch.equal(table[:, 1], before[:, 1] + marks)


@pytest.mark.gpu
def test_gpu_l2_prefetch_rows_in_graph_after_the_qkv_gemv() -> None:
    """The spare prefetch programs under PDL in a CUDA graph (issued before the PDL wait):
    output and cache bytes equal an eager run without them, replay after replay, and the
    prefetched weights are unchanged."""
    table, weights = _weights_table("cuda")
    before = [w.clone() for w in weights]
    cfg = _replay_after_qkv_gemv(
        [200, 70], lambda cfg, captured: {"config": cfg, "l2_prefetch": table if captured else None})
    assert cfg.num_splits > 1  # the launch that gets the spare row
    assert all(torch.equal(a, b) for a, b in zip(weights, before, strict=True))
