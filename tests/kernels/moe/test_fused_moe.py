"""Triton MoE kernels (kernels/moe/fused_moe.py) against their twin (kernels/moe/reference.py).

CPU: Triton's interpreter, float32 activations (bf16 tl.dot is wrong in the interpreter), tiny
shapes; both paths (grouped GEMM, decode GEMVs) on several expert counts, top-k values and
token counts that leave experts empty, with 16-bit, int8, fp8 and int4 experts (groups of
32 / 64 / 20 along K, short last groups), and with slots
routed to experts held elsewhere (-1). GPU (`-m gpu`): bf16 on a Qwen3-30B-A3B layer shape
(16-bit, fp8 and int4 experts).
"""
from __future__ import annotations

import pytest
import torch

from slipstream.kernels.gemv.dense import counters
from slipstream.kernels.moe import fused_moe as fm
from slipstream.kernels.moe import reference as ref
from slipstream.quantization.utils import quantize_fp8_per_channel, quantize_int8_per_channel

PATHS = ["grouped", "decode"]


def _path(path: str) -> dict:
    """fused_moe's keywords that force one path."""
    return {"decode": path == "decode"}


def _experts(num_experts, hidden, inter, fmt=None, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device) * 0.2
    w2 = torch.randn(num_experts, hidden, inter, generator=g, device=device) * 0.2
    if fmt is None:
        return w13.to(dtype), w2.to(dtype), None, None
    quantize = quantize_int8_per_channel if fmt == "int8" else quantize_fp8_per_channel
    q13, s13 = quantize(w13.reshape(-1, hidden))
    q2, s2 = quantize(w2.reshape(-1, inter))
    return (q13.view(w13.shape), q2.view(w2.shape), s13.view(num_experts, -1),
            s2.view(num_experts, -1))


def _routing(num_tokens, num_experts, top_k, seed=1, device="cpu"):
    logits = torch.randn(num_tokens, num_experts, device=device,
                         generator=torch.Generator(device=device).manual_seed(seed))
    return ref.route_topk(logits, top_k, renormalize=True)


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("num_experts,top_k,num_tokens,fmt", [
    (4, 1, 3, None),  # 3 tokens, 4 experts: at least one expert gets nothing
    (8, 2, 5, "int8"),
    (6, 3, 2, "fp8"),
    (16, 4, 1, None),  # one decode token: 12 of 16 experts empty
])
@pytest.mark.parametrize("path", PATHS)
def test_fused_moe_matches_reference(num_experts, top_k, num_tokens, fmt, path):
    hidden, inter = 32, 48  # inter: not a multiple of the 32-column tiles below (masked)
    w13, w2, s13, s2 = _experts(num_experts, hidden, inter, fmt)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(2))
    weights, ids = _routing(num_tokens, num_experts, top_k)
    assert len(set(ids.flatten().tolist())) < num_experts  # some experts are left empty
    want = ref.fused_moe(x, w13, w2, weights, ids, s13, s2)
    got = fm.fused_moe(x, w13, w2, weights, ids, s13, s2, **_path(path),
                       gemm=fm.GemmConfig(16, 32, 16, 4, 1), gemv=fm.GemvConfig(32, 16, 4))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("path", PATHS)
def test_slots_of_experts_held_elsewhere_add_nothing(path):
    w13, w2, _, _ = _experts(4, 32, 16)
    x = torch.randn(3, 32)
    weights, ids = _routing(3, 4, 2)
    ids[0, 1] = -1
    ids[2] = -1  # a token with no local expert at all: zeros
    want = ref.fused_moe(x, w13, w2, weights, ids)
    got = fm.fused_moe(x, w13, w2, weights, ids, **_path(path),
                       gemm=fm.GemmConfig(16, 16, 16, 4, 1), gemv=fm.GemvConfig(16, 16, 4))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert torch.count_nonzero(got[2]) == 0


def test_decode_sum_is_deterministic_and_leaves_counters_at_zero():
    """The down kernel's last arriver sums a token's k partial rows in slot order: the same
    bits on every call, and the arrival counters it shares with the dense GEMVs are back at
    zero for the next call."""
    w13, w2, _, _ = _experts(8, 32, 48)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(4))
    weights, ids = _routing(3, 8, 4)
    ids[1, 2] = -1
    cfg = fm.GemvConfig(16, 16, 4)  # 2 column tiles per token
    first = fm.fused_moe(x, w13, w2, weights, ids, decode=True, gemv=cfg)
    assert torch.count_nonzero(counters(x.device, 6)) == 0
    again = fm.fused_moe(x, w13, w2, weights, ids, decode=True, gemv=cfg)
    assert torch.equal(first, again)
    torch.testing.assert_close(first, ref.fused_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("num_experts,top_k,renormalize", [(8, 2, True), (6, 3, False),
                                                          (5, 1, True)])
def test_route_topk_matches_reference(num_experts, top_k, renormalize):
    logits = torch.randn(7, num_experts, generator=torch.Generator().manual_seed(3))
    want_w, want_ids = ref.route_topk(logits, top_k, renormalize)
    got_w, got_ids = fm.route_topk(logits, top_k, renormalize)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w)


def test_align_by_expert_blocks():
    ids = torch.tensor([[3, 1], [1, -1], [0, 3], [3, 1]], dtype=torch.int32)
    pairs, experts, used = ref.align_by_expert(ids, num_experts=5, block_m=4)
    assert used.tolist() == [12] and experts.tolist()[:4] == [0, 1, 3, -1]
    blocks = pairs.view(-1, 4).tolist()
    assert blocks[:3] == [[4, 8, 8, 8], [1, 2, 7, 8], [0, 5, 6, 8]]  # 8 = padding (P)
    assert all(v == 8 for row in blocks[3:] for v in row)


def test_shape_errors_and_empty_batch():
    w13, w2, _, _ = _experts(4, 32, 16)
    weights, ids = _routing(2, 4, 2)
    with pytest.raises(ValueError, match="shapes do not match"):
        fm.fused_moe(torch.randn(2, 16), w13, w2, weights, ids)
    with pytest.raises(ValueError, match="top_k"):
        fm.route_topk(torch.randn(2, 4), 5, True)
    empty = fm.fused_moe(torch.randn(0, 32), w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 64, 512])
@pytest.mark.parametrize("fmt", [None, "fp8"])
def test_fused_moe_gpu_qwen3_moe_layer(num_tokens, fmt):
    w13, w2, s13, s2 = _experts(128, 2048, 768, fmt, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(num_tokens, 2048, device="cuda").to(torch.bfloat16)
    logits = torch.randn(num_tokens, 128, device="cuda")
    weights, ids = fm.route_topk(logits, 8, True)
    want_w, want_ids = ref.route_topk(logits, 8, True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w)
    want = ref.fused_moe(x.float(), w13.float() if fmt is None else w13, w2.float()
                         if fmt is None else w2, weights, ids, s13, s2)
    got = {path: fm.fused_moe(x, w13, w2, weights, ids, s13, s2, **_path(path))
           for path in PATHS}
    for out in got.values():
        assert ((out.float() - want).norm() / want.norm()).item() < 1e-2


def _int4_experts(num_experts, hidden, inter, group, device="cpu", seed=0):
    """Random experts quantized to int4 (round to nearest, groups of `group` along K)."""
    from slipstream.quantization.utils import pack_int4_rows, quantize_int4_groupwise

    g = torch.Generator(device=device).manual_seed(seed)
    out = []
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):
        w = torch.randn(num_experts * rows, cols, generator=g, device=device) * 0.2
        q, scale, zero = quantize_int4_groupwise(w, group)
        out.append((pack_int4_rows(q).view(num_experts, rows, cols // 2),
                    scale.half().view(num_experts, rows, -1), zero.view(num_experts, rows, -1)))
    (w13, s13, z13), (w2, s2, z2) = out
    return w13, w2, s13, s2, ref.Int4Experts(z13, z2, group)


@pytest.mark.usefixtures("poison_outputs")
@pytest.mark.parametrize("num_experts,top_k,num_tokens,group", [
    (4, 1, 3, 32),  # K = 64 / 48: whole groups, and a short last group for the down weight
    (8, 2, 5, 64),  # one group of 64 (gate/up), one short group of 48 (down)
    (6, 3, 2, 20),  # groups that straddle the K tiles, short last groups
])
@pytest.mark.parametrize("path", PATHS)
def test_int4_experts_match_reference(num_experts, top_k, num_tokens, group, path):
    hidden, inter = 64, 48
    w13, w2, s13, s2, int4 = _int4_experts(num_experts, hidden, inter, group)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(2))
    weights, ids = _routing(num_tokens, num_experts, top_k)
    assert len(set(ids.flatten().tolist())) < num_experts  # some experts are left empty
    want = ref.fused_moe(x, w13, w2, weights, ids, s13, s2, int4)
    got = fm.fused_moe(x, w13, w2, weights, ids, s13, s2, int4, **_path(path),
                       gemm=fm.GemmConfig(16, 32, 16, 4, 1), gemv=fm.GemvConfig(32, 16, 4))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 512])
def test_int4_experts_gpu_qwen3_moe_layer(num_tokens):
    """bf16 activations, int4 experts in groups of 128 on a Qwen3-30B-A3B layer: both paths
    against the reference in float32 on the same dequantized weights."""
    w13, w2, s13, s2, int4 = _int4_experts(128, 2048, 768, 128, device="cuda")
    x = torch.randn(num_tokens, 2048, device="cuda").to(torch.bfloat16)
    weights, ids = fm.route_topk(torch.randn(num_tokens, 128, device="cuda"), 8, True)
    want = ref.fused_moe(x.float(), w13, w2, weights, ids, s13, s2, int4)
    for path in PATHS:
        got = fm.fused_moe(x, w13, w2, weights, ids, s13, s2, int4, **_path(path))
        assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
