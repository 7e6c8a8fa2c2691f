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


@pytest.mark.parametrize("slots,k,shards,n,rank", [
    ([1], 1024, (0, 64, 96), 128, 16),       # batch-1 decode: K over 4 programs, q/k/v shards
    ([0, -1, 2, 2, 1, 0, -1, 2], 96, (0, 32), 64, 8),  # mixed adapters and base rows, unsplit
    ([2, 2, 2], 512, (0,), 300, 4),          # several column chunks, the last one partial
])
def test_fused_shrink_expand_matches_reference(slots: list[int], k: int,
                                               shards: tuple[int, ...], n: int,
                                               rank: int) -> None:
    from slipstream.kernels.lora import triton_lora

    torch.manual_seed(1)
    num_slots = 3
    meta = _meta(slots, num_slots)
    x = torch.randn(len(slots), k)
    a = torch.randn(num_slots, len(shards) * rank, k) * 0.1
    b = torch.randn(num_slots, n, rank) * 0.1
    y0 = torch.randn(len(slots), n)
    want = reference.lora_add(x, y0.clone(), a, b, meta, shards)
    scratch = triton_lora.fused_scratch([(k, shards, n)], rank, num_slots, "cpu")
    for _ in range(2):  # the arrival counters are left at zero for the next launch
        got = triton_lora.lora_shrink_expand(x, y0.clone(), a, b, meta, shards, scratch)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert not scratch[1].any()
    used = torch.tensor(slots) >= 0
    assert torch.equal(got[~used], y0[~used])
    assert not torch.allclose(got[used], y0[used])  # the delta really was added


@pytest.mark.parametrize("slots,k", [
    ([2], 512),                          # one row: one kernel, K split over programs
    ([-1], 512),                         # one row without an adapter: the activation alone
    ([1], 64),                           # one row, K unsplit
    ([0, -1, 2, 2, 1], 64),              # a few rows: fused lora_add, then the activation
    ([2, -1, 0] * 6 + [1, 1], 64),       # more rows: shrink, then expand + activation
])
def test_lora_act_matches_reference(slots: list[int], k: int) -> None:
    """silu(gate) * up of a [gate | up] projection with the delta added inside the LoRA
    kernels, on each of its paths."""
    from slipstream.kernels.lora import triton_lora

    torch.manual_seed(2)
    num_slots, inter, rank = 3, 160, 8
    shards = (0, inter)
    meta = _meta(slots, num_slots)
    x = torch.randn(len(slots), k)
    a = torch.randn(num_slots, 2 * rank, k) * 0.1
    b = torch.randn(num_slots, 2 * inter, rank) * 0.1
    y = torch.randn(len(slots), 2 * inter)
    y0 = y.clone()
    want = reference.lora_act(x, y, a, b, meta, shards)
    scratch = triton_lora.fused_scratch([(k, shards, 2 * inter)], rank, num_slots, "cpu")
    for _ in range(2):
        got = triton_lora.lora_act(x, y.clone(), a, b, meta, shards, scratch)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert not scratch[1].any()
    assert torch.equal(y, y0)
    base = torch.tensor(slots) < 0  # rows without an adapter: the plain activation
    torch.testing.assert_close(got[base], reference.silu_and_mul(y[base]))
    if not base.all():
        assert not torch.allclose(got[~base], reference.silu_and_mul(y[~base]))


def test_fused_plan_at_llama_8b_shapes() -> None:
    """Columns per program divide the shard starts; K splits into runs of at most 512."""
    from slipstream.kernels.lora.triton_lora import fused_plan

    for k, shards, n in [(4096, (0, 4096, 5120), 6144), (4096, (0,), 4096),
                         (4096, (0, 14336), 28672), (14336, (0,), 4096)]:
        plan = fused_plan(k, shards, n, 16)
        assert all(s % plan.cols == 0 for s in shards) and plan.cols >= 128
        assert plan.split > 1 and -(-k // plan.split) <= 512
        chunks = -(-n // plan.cols)
        assert chunks * 16 * k * 2 <= 4 << 20 or plan.cols == 128


def test_shrink_split_fills_the_gpu_then_stops_splitting() -> None:
    from slipstream.kernels.lora.triton_lora import shrink_split

    assert shrink_split(1, 4096, 16, 1) == 16  # one decode row: K over 16 programs
    assert shrink_split(512, 4096, 64, 1) == 16  # 8 full tiles still split
    assert shrink_split(512, 14336, 64, 1) == 32  # 8 tiles x 32 = the target
    assert shrink_split(1, 14336, 16, 1) == 32
    assert shrink_split(8192, 4096, 64, 1) == 2  # prefill: 128 tiles nearly fill the GPU
    assert shrink_split(16384, 4096, 64, 1) == 1
    assert shrink_split(5, 128, 16, 1) == 1  # K too short to split


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
    # The fused kernel (K split over programs, the last to arrive expands): many launches on
    # one scratch pair, each right (the counters reset themselves), batch-1 and 16 mixed rows.
    for rows_few in (1, triton_lora.FUSED_MAX_ROWS):
        few = _meta(slots[:rows_few], num_slots, "cuda")
        scratch = triton_lora.fused_scratch([(k, shards, 6144)], rank, num_slots, "cuda")
        want = reference.lora_add(x[:rows_few], y[:rows_few].clone(), a, b, few, shards)
        for _ in range(20):
            got = triton_lora.lora_add(x[:rows_few], y[:rows_few].clone(), a, b, few, shards,
                                       scratch)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        assert not scratch[1].any()
    # One row of gate/up: delta and SiLU-and-mul in one kernel (Llama-3.1-8B's shape).
    inter, gu_shards = 14336, (0, 14336)
    a_gu = (torch.randn(num_slots, 2 * rank, k, device="cuda") * 0.02).bfloat16()
    b_gu = (torch.randn(num_slots, 2 * inter, rank, device="cuda") * 0.02).bfloat16()
    y_gu = torch.randn(1, 2 * inter, device="cuda", dtype=torch.bfloat16)
    one = _meta(slots[:1], num_slots, "cuda")
    scratch = triton_lora.fused_scratch([(k, gu_shards, 2 * inter)], rank, num_slots, "cuda")
    want = reference.lora_act(x[:1], y_gu, a_gu, b_gu, one, gu_shards)
    for _ in range(20):
        got = triton_lora.lora_act(x[:1], y_gu, a_gu, b_gu, one, gu_shards, scratch)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert not scratch[1].any()
