"""Triton paged attention with a sliding window and attention-logit soft-capping against the
reference twin, in Triton's interpreter (float32, tiny). Blocks wholly before every query's
window are filled with NaN: the KV manager may have freed them, so no program may read them."""

from __future__ import annotations

import pytest
import torch

from slipstream.bench.attn_batch import make_batch
from slipstream.kernels import reference
from slipstream.kernels.attention.paged import AttnConfig, RopeInput, paged_attention

pytestmark = pytest.mark.usefixtures("poison_outputs")
ATOL, RTOL = 2e-5, 2e-5


def _poison_before_window(kc, vc, meta, window: int) -> None:
    qsl, block_size = meta.query_start_loc_cpu, kc.shape[1]
    for s, seq_len in enumerate(meta.seq_lens_cpu):
        first = reference.window_start(seq_len - (qsl[s + 1] - qsl[s]), window) // block_size
        for b in meta.block_tables[s, :first].tolist():
            kc[b] = vc[b] = float("nan")


@pytest.mark.parametrize(
    "cfg",
    [
        AttnConfig(block_m=16, block_n=16, num_splits=1, num_warps=4, num_stages=1),
        AttnConfig(block_m=32, block_n=16, num_splits=3, num_warps=4, num_stages=1),
        AttnConfig(16, 16, 4, 4, 2, short_chain=1),
    ],
    ids=["one-split", "three-splits", "short-chain"],
)
@pytest.mark.parametrize("window,softcap", [(20, None), (7, 3.0)])
def test_mixed_batch_window_softcap(cfg: AttnConfig, window: int, softcap) -> None:
    """Prefill chunks longer than the window beside decodes past it."""
    q, kc, vc, meta = make_batch(
        [1, 9, 30, 2],
        [70, 40, 30, 18],
        num_kv_heads=1,
        group=2,
        head_dim=16,
        block_size=8,
        dtype=torch.float32,
        seed=window,
    )
    _poison_before_window(kc, vc, meta, window)
    opts = {"sliding_window": window, "logit_softcap": softcap}
    want = reference.paged_attention(q, kc, vc, meta, 0.5, **opts)
    got = paged_attention(q, kc, vc, meta, 0.5, config=cfg, **opts)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize(
    "cfg",
    [AttnConfig(16, 16, 1, 4, 1), AttnConfig(16, 16, 3, 4, 1, preload=True)],
    ids=["plain", "split-preload"],
)
def test_fused_rope_decode_window(cfg: AttnConfig) -> None:
    """Decode with RoPE and the KV write in the kernel, the first tile read early (preload)."""
    lens, hkv, d = [50, 9, 33], 1, 16
    q, kc, vc, meta = make_batch(
        [1] * 3, lens, num_kv_heads=hkv, group=2, head_dim=d, block_size=8, dtype=torch.float32, seed=3
    )
    _poison_before_window(kc, vc, meta, 12)
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn((3, hkv, d), generator=gen), torch.randn((3, hkv, d), generator=gen)
    positions = torch.tensor([n - 1 for n in lens])
    inv = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    freqs = torch.arange(64, dtype=torch.float32)[:, None] * inv[None, :]
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    kc2, vc2 = kc.clone(), vc.clone()
    q_rot, _ = reference.rotary_and_cache_write(q, k, v, positions, cos_sin, kc2, vc2, meta.slot_mapping)
    want = reference.paged_attention(q_rot, kc2, vc2, meta, 0.5, sliding_window=12, logit_softcap=4.0)
    got = paged_attention(
        q,
        kc,
        vc,
        meta,
        0.5,
        config=cfg,
        sliding_window=12,
        logit_softcap=4.0,
        rope=RopeInput(k, v, positions, cos_sin),
    )
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.gpu
def test_window_softcap_bf16_gpu() -> None:
    """bf16 on the GPU over long contexts, the default tile choice, against the oracle."""
    q, kc, vc, meta = make_batch(
        [1, 1, 300, 1],
        [4000, 700, 1200, 90],
        num_kv_heads=4,
        group=4,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        seed=2,
    )
    for window, cap in [(512, None), (256, 50.0), (4096, None)]:
        opts = {"sliding_window": window, "logit_softcap": cap}
        want = reference.paged_attention(q, kc, vc, meta, 0.08, **opts)
        got = paged_attention(q, kc, vc, meta, 0.08, **opts)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
