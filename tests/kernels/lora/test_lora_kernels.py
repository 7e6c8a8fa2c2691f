"""Triton LoRA shrink / expand against their reference twins (interpreter on the CPU), over
batches that mix adapters, rows without one, fused shards and split-K."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from slipstream.kernels.lora import reference
from slipstream.kernels.lora.meta import meta_views, pack_meta

pytestmark = pytest.mark.usefixtures("poison_outputs")


def _meta(slots: list[int], num_slots: int, device: str = "cpu"):
    packed = torch.from_numpy(pack_meta(np.array(slots), num_slots)).to(device)
    return meta_views(packed, len(slots), num_slots)


def test_pack_meta_tiles_cover_each_slot_once() -> None:
    slots = [2, -1, 0, 2, 2, 0, -1] + [1] * 20
    meta = _meta(slots, 3)
    seen = []
    for s, start, n in zip(meta.tile_slot.tolist(), meta.tile_start.tolist(),
                           meta.tile_len.tolist()):
        if s < 0:
            assert n == 0
            continue
        assert 0 < n <= meta.block_m
        rows = meta.sorted_ids[start:start + n].tolist()
        assert all(slots[r] == s for r in rows)
        seen += rows
    assert sorted(seen) == [i for i, s in enumerate(slots) if s >= 0]


@pytest.mark.parametrize("rows,k,shards,rank", [
    (5, 512, (0,), 8),            # decode-sized: split K, one shard
    (9, 96, (0, 64, 96), 16),     # q/k/v-like shards
    (140, 64, (0, 32), 4),        # prefill-sized tiles (block 64), gate/up-like
])
def test_shrink_expand_match_reference(rows: int, k: int, shards: tuple[int, ...],
                                       rank: int) -> None:
    from slipstream.kernels.lora import triton_lora

    torch.manual_seed(0)
    num_slots, n = 3, shards[-1] + (shards[-1] - shards[-2] if len(shards) > 1 else 48)
    n = max(n, 48)
    gen = np.random.default_rng(0)
    slots = gen.integers(-1, num_slots, rows).tolist()
    slots[0] = 1  # at least one row with an adapter
    meta = _meta(slots, num_slots)
    x = torch.randn(rows, k)
    a = torch.randn(num_slots, len(shards) * rank, k) * 0.1
    b = torch.randn(num_slots, n, rank) * 0.1
    want_h = reference.lora_shrink(x, a, meta)
    got_h = triton_lora.lora_shrink(x, a, meta)
    used = torch.tensor(slots) >= 0
    torch.testing.assert_close(got_h[used], want_h[used], atol=1e-4, rtol=1e-4)
    y0 = torch.randn(rows, n)
    want = reference.lora_expand(y0.clone(), want_h, b, meta, shards)
    got = triton_lora.lora_expand(y0.clone(), want_h, b, meta, shards)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[~used], y0[~used])  # rows without an adapter are untouched


def test_shrink_splits_k_only_for_decode_sized_batches() -> None:
    from slipstream.kernels.lora.triton_lora import shrink_split

    assert shrink_split(1, 4096) == 16  # one decode row: K over 16 programs
    assert shrink_split(64, 14336) == 16  # at most 16
    assert shrink_split(65, 4096) == 1  # enough tiles to fill the GPU unsplit
    assert shrink_split(5, 512) == 2  # runs of at least 256 of K
    assert shrink_split(5, 128) == 1  # K too short to split


@pytest.mark.gpu
def test_triton_lora_bf16_on_gpu() -> None:
    from slipstream.kernels.lora import triton_lora

    torch.manual_seed(0)
    rows, k, shards, rank, num_slots = 300, 4096, (0, 4096, 5120), 16, 8
    slots = torch.randint(-1, num_slots, (rows,)).tolist()
    slots[0] = 3  # the batch-1 case below has an adapter
    meta = _meta(slots, num_slots, "cuda")
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    a = (torch.randn(num_slots, 3 * rank, k, device="cuda") * 0.02).bfloat16()
    b = (torch.randn(num_slots, 6144, rank, device="cuda") * 0.02).bfloat16()
    y = torch.randn(rows, 6144, device="cuda", dtype=torch.bfloat16)
    want = reference.lora_expand(y.clone(), reference.lora_shrink(x, a, meta), b, meta, shards)
    got = triton_lora.lora_expand(y.clone(), triton_lora.lora_shrink(x, a, meta), b, meta, shards)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    # lora_add into a caller's zeroed buffer (the engine's shared workspace), K split at one
    # and 16 rows, unsplit at 300.
    for rows_few in (1, 16, rows):
        few = _meta(slots[:rows_few], num_slots, "cuda")
        want = reference.lora_add(x[:rows_few], y[:rows_few].clone(), a, b, few, shards)
        h = torch.zeros(rows_few, 3 * rank, device="cuda")
        got = triton_lora.lora_add(x[:rows_few], y[:rows_few].clone(), a, b, few, shards, h)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
