"""The CPU kernel table's batched paged attention (kernels/cpu.py) against the reference oracle."""
from __future__ import annotations

import pytest
import torch

from slipstream.bench.attn_batch import make_batch
from slipstream.kernels import cpu, get_ops, reference

pytestmark = pytest.mark.usefixtures("poison_outputs")
ATOL, RTOL = 2e-5, 2e-5


def _check(q, kc, vc, meta, scale=0.125, **kv) -> None:
    want = reference.paged_attention(q, kc, vc, meta, scale, **kv)
    got = cpu.paged_attention(q, kc, vc, meta, scale, **kv)
    real = meta.query_start_loc_cpu[-1]  # rows past the last sequence are padding
    torch.testing.assert_close(got[:real], want[:real], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1, 7, 1, 20, 3], [1, 30, 45, 20, 70]),  # decodes between prefill chunks (own rows)
    ([1, 1, 1, 1], [17, 3, 64, 40]),  # pure decode, ragged lengths (padding + mask)
    ([1, 1, 1], [32, 32, 32]),  # pure decode, equal lengths (no mask)
    ([12, 5], [12, 40]),  # prefill only: no prefix (causal) and a cached prefix
    ([4, 1, 1], [4, 9, 2]),  # the decodes after the prefill rows (not rows 0..Sd-1)
])
@pytest.mark.parametrize("group", [1, 3])
def test_matches_reference(query_lens, seq_lens, group: int) -> None:
    q, kc, vc, meta = make_batch(query_lens, seq_lens, num_kv_heads=2, group=group,
                                 head_dim=64, block_size=16, dtype=torch.float32, seed=group)
    _check(q, kc, vc, meta)


def test_padding_rows_and_bf16() -> None:
    q, kc, vc, meta = make_batch([1, 1, 6], [9, 33, 6], num_kv_heads=3, group=3, head_dim=64,
                                 block_size=16, dtype=torch.bfloat16, pad_tokens=3, seed=5)
    want = reference.paged_attention(q, kc, vc, meta, 0.125)
    got = cpu.paged_attention(q, kc, vc, meta, 0.125)
    real = meta.query_start_loc_cpu[-1]
    torch.testing.assert_close(got[:real].float(), want[:real].float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantized_cache(dtype: torch.dtype) -> None:
    q, kc, vc, meta = make_batch([1, 5, 1], [20, 5, 50], num_kv_heads=2, group=2, head_dim=64,
                                 block_size=16, dtype=torch.float32, seed=3)
    k_scale, v_scale = torch.tensor(0.02), torch.tensor(0.03)
    kq = reference.quantize_kv(kc, dtype, k_scale)
    vq = reference.quantize_kv(vc, dtype, v_scale)
    _check(q, kq, vq, meta, k_scale=k_scale, v_scale=v_scale)


def test_plan_is_built_once_per_step() -> None:
    """Every layer of a step reuses the gather plan cached on the step's metadata."""
    q, kc, vc, meta = make_batch([1, 1], [10, 20], num_kv_heads=2, group=2, head_dim=64,
                                 block_size=16, dtype=torch.float32)
    cpu.paged_attention(q, kc, vc, meta, 0.125)
    plan = meta.__dict__[cpu._PLAN_ATTR][None]
    cpu.paged_attention(q, kc, vc, meta, 0.125)
    assert meta.__dict__[cpu._PLAN_ATTR][None] is plan


@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1, 7, 1, 20, 3], [1, 30, 45, 20, 70]),
    ([1, 1, 1, 1], [17, 3, 64, 40]),
])
@pytest.mark.parametrize("window", [5, 16, 33])
def test_sliding_window_matches_reference(query_lens, seq_lens, window: int) -> None:
    """Only the blocks the window reaches are gathered; blocks before it may hold anything
    (the KV manager frees them), so they are filled with NaN here."""
    q, kc, vc, meta = make_batch(query_lens, seq_lens, num_kv_heads=2, group=2, head_dim=64,
                                 block_size=16, dtype=torch.float32, seed=window)
    _poison_blocks_before_window(kc, vc, meta, window)
    _check(q, kc, vc, meta, sliding_window=window)
    _check(q, kc, vc, meta, sliding_window=window, logit_softcap=2.0)


def _poison_blocks_before_window(kc, vc, meta, window: int) -> None:
    qsl, block_size = meta.query_start_loc_cpu, kc.shape[1]
    for s, seq_len in enumerate(meta.seq_lens_cpu):
        first = reference.window_start(seq_len - (qsl[s + 1] - qsl[s]), window) // block_size
        for b in meta.block_tables[s, :first].tolist():
            kc[b] = vc[b] = float("nan")


def test_sliding_window_and_softcap_change_the_result() -> None:
    """Guards the tests above: the window and the cap are applied at all."""
    q, kc, vc, meta = make_batch([1, 9], [40, 30], num_kv_heads=2, group=2, head_dim=64,
                                 block_size=16, dtype=torch.float32, seed=1)
    full = reference.paged_attention(q, kc, vc, meta, 1.0)
    windowed = reference.paged_attention(q, kc, vc, meta, 1.0, sliding_window=8)
    capped = reference.paged_attention(q, kc, vc, meta, 1.0, logit_softcap=1.0)
    assert (full - windowed).abs().max() > 1e-2 and (full - capped).abs().max() > 1e-2


def test_cpu_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto on the CPU: the batched attention; SLIPSTREAM_KERNELS=reference: the plain oracle."""
    monkeypatch.setenv("SLIPSTREAM_KERNELS", "auto")
    assert get_ops("cpu").paged_attention is cpu.paged_attention
    assert get_ops("cpu").rms_norm is cpu.rms_norm
    assert get_ops("cpu").apply_rotary is reference.apply_rotary
    monkeypatch.setenv("SLIPSTREAM_KERNELS", "reference")
    assert get_ops("cpu").paged_attention is reference.paged_attention
