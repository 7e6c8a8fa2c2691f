"""Triton paged attention for the flat mixed batch: prefill chunks and decode tokens in one launch.

Same semantics as paged_attention in kernels/reference.py (its twin). Bound by reading K/V at
long contexts and large batches, by the latency of its chain of tiles at batch 1.

Each program takes one tile of query rows (BLOCK_Q tokens x the GROUP query heads that share one
KV head, so every K/V tile is loaded once per group), walks the sequence's K/V through its block
table with an online softmax, and for long contexts with few programs splits the KV range
across programs (flash-decoding); the last split of a tile to finish merges the partial
results. Metadata is read from device tensors only. fp8 / int8 caches are read as stored
values: k_scale folds into the score scale and v_scale into the output, so the inner loop only
adds a widening cast.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.attention.backend import AttentionMetadata
from slipstream.kernels.attention.l2_prefetch import OFF as PF_OFF
from slipstream.kernels.attention.l2_prefetch import PREFETCH as PF_ON
from slipstream.kernels.attention.l2_prefetch import prefetch_spans
from slipstream.kernels.attention.l2_spans import chunk_bytes as l2_prefetch_chunk
from slipstream.kernels.attention.l2_spans import supported as l2_supported
from slipstream.kernels.attention.rotary_cache import (
    check_cache,
    kv_quant_args,
    load_rotated,
    store_new_kv,
)
from slipstream.kernels.gemv.dense import num_sms
from slipstream.kernels.runtime import pdl
from slipstream.kernels.runtime.pdl import pdl_release, pdl_wait

_LOG2E = 1.4426950408889634
# A decode program's latency is its chain of K/V tiles (each a gathered load, then its math):
# at least one 64-token tile a split keeps the chain short and the merge cheap.
_MIN_TOKENS_PER_SPLIT = 64
_MAX_SPLITS = 64
_MAX_SCRATCH_BYTES = 256 << 20
# Warps of split decode launches (few sequences, the KV range across programs): 8 beat 2 and 4.
_SPLIT_WARPS = 8
# A split of at most this many tiles loads them plainly in one loop, skipping the prologue and
# epilogue of the staged loops' cp.async pipeline, which longer splits keep (latency-bound
# batch-1 decode). Decided per program at run time, so one captured graph serves short and long
# contexts.
_SHORT_CHAIN_TILES = 2
# Rows of spare programs appended to split decode launches given a span table, to prefetch the
# next GEMVs' weights into L2 (kernels/attention/l2_spans.py); a row is kv_heads x splits
# programs.
_PF_ROWS = 1
_PF_CPU_MODE = PF_OFF  # the spare row's prefetch_spans MODE off CUDA (tests set RECORD)


@triton.jit
def _find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest s with qsl[s] // BLOCK_Q + s <= pid: the sequence whose q-tiles hold program pid."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


@triton.jit
def _quantized_to_f16(v, KV_QUANT: tl.constexpr, ASM_CVT: tl.constexpr):
    """A K or V tile of an fp8 / int8 cache as fp16, exactly. The PTX versions are marked impure
    so Triton converts the tile before it goes through shared memory into the product's layout:
    otherwise it keeps V in 8 bits there and reads it back one byte per value (sm_90 has no 8-bit
    transposed ldmatrix), which made an fp8 cache slower than bf16."""
    if not ASM_CVT:  # the interpreter runs no PTX
        return v.to(tl.float16)
    elif KV_QUANT == 1:  # one conversion instruction per pair
        return tl.inline_asm_elementwise(
            asm="""{ .reg .b16 lo, hi;
            mov.b32 {lo, hi}, $2;
            cvt.rn.f16x2.e4m3x2 $0, lo;
            cvt.rn.f16x2.e4m3x2 $1, hi; }""",
            constraints="=r,=r,r", args=[v.to(tl.uint8, bitcast=True)], dtype=tl.float16,
            is_pure=False, pack=4)
    else:  # int8: the fp16 bits 0x64uu are 1024 + uu; uu = byte ^ 0x80 = value + 128
        return tl.inline_asm_elementwise(
            asm="""{ .reg .b32 t, bias;
            xor.b32 t, $2, 0x80808080;
            mov.b32 bias, 0x64806480;
            prmt.b32 $0, t, 0x64646464, 0x5140;
            prmt.b32 $1, t, 0x64646464, 0x5342;
            sub.f16x2 $0, $0, bias;
            sub.f16x2 $1, $1, bias; }""",
            constraints="=r,=r,r", args=[v], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _attn_tile(acc, m_i, l_i, q, tile, bt_row, k_ptr, v_ptr, kv_head_off_k, kv_head_off_v,
               stride_kb, stride_ks, stride_vb, stride_vs, q_pos, seq_len, qk_scale,
               tree_bits, ctx_len, kv_start, window, cap_log2,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
               PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr,
               F16_KV: tl.constexpr, P_DTYPE: tl.constexpr, KV_QUANT: tl.constexpr,
               ASM_CVT: tl.constexpr, TREE: tl.constexpr, SLIDING: tl.constexpr,
               SOFTCAP: tl.constexpr):
    """One K/V tile of BLOCK_N tokens: scores, online-softmax update, accumulate P @ V."""
    kt, v = _tile_kv(tile, bt_row, k_ptr, v_ptr, kv_head_off_k, kv_head_off_v, stride_kb,
                     stride_ks, stride_vb, stride_vs, kv_start, seq_len, BLOCK_N, BLOCK_D,
                     HEAD_DIM, PAGE_SIZE, SLIDING)
    return _tile_update(acc, m_i, l_i, q, kt, v, tile, q_pos, seq_len, qk_scale, tree_bits,
                        ctx_len, window, cap_log2, BLOCK_N, MASKED, DOT_PREC, F16_KV, P_DTYPE,
                        KV_QUANT, ASM_CVT, TREE, SLIDING, SOFTCAP)


@triton.jit
def _tile_kv(tile, bt_row, k_ptr, v_ptr, kv_head_off_k, kv_head_off_v, stride_kb, stride_ks,
             stride_vb, stride_vs, kv_start, kv_end, BLOCK_N: tl.constexpr,
             BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
             SLIDING: tl.constexpr = False):
    """K ([D, N], transposed) and V ([N, D]) of one tile as stored; positions >= kv_end read 0,
    and with SLIDING those before kv_start too (their blocks may be freed: the table entry is
    not even read)."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_ok = offs_n < kv_end
    if SLIDING:
        kv_ok = kv_ok & (offs_n >= kv_start)
    d_ok = offs_d < HEAD_DIM  # constant over runs of 16 (head_dim % 16 == 0): loads stay wide
    blk = tl.load(bt_row + offs_n // PAGE_SIZE, mask=kv_ok, other=0).to(tl.int64)
    row = (offs_n % PAGE_SIZE).to(tl.int64)
    k_off = blk * stride_kb + row * stride_ks + kv_head_off_k
    v_off = blk * stride_vb + row * stride_vs + kv_head_off_v
    # K is loaded transposed ([D, N]) so the score product needs no layout change. fp8 / int8
    # values convert exactly to fp16 (or float32); their scales act outside.
    kt = tl.load(k_ptr + k_off[None, :] + offs_d[:, None],
                 mask=kv_ok[None, :] & d_ok[:, None], other=0.0)
    # V is requested with K, before the score math: one memory round trip per tile, not two.
    v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :],
                mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
    return kt, v


@triton.jit
def _tile_update(acc, m_i, l_i, q, kt, v, tile, q_pos, seq_len, qk_scale, tree_bits, ctx_len,
                 window, cap_log2, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 DOT_PREC: tl.constexpr, F16_KV: tl.constexpr, P_DTYPE: tl.constexpr,
                 KV_QUANT: tl.constexpr, ASM_CVT: tl.constexpr, TREE: tl.constexpr = False,
                 SLIDING: tl.constexpr = False, SOFTCAP: tl.constexpr = False):
    """Scores of q against one loaded tile, the online-softmax update, acc += P @ V.
    TREE: tree_bits ([BLOCK_M] int64) is each row's set of visible chunk positions (bit j:
    position ctx_len + j; -1 for ordinary causal rows), see speculative/tree.py.
    SOFTCAP: qk_scale is scale / cap and the scores become tanh(.) * cap (in log2 units,
    cap_log2); SLIDING: a row at position p sees keys above p - window only."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    kv_ok = offs_n < seq_len
    if F16_KV:
        s = tl.dot(q, _quantized_to_f16(kt, KV_QUANT, ASM_CVT)) * qk_scale
    else:
        s = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PREC) * qk_scale
    if SOFTCAP:  # tanh(x) = 1 - 2 / (e^2x + 1): saturates to +-1 without inf - inf
        s = (1.0 - 2.0 / (tl.math.exp2(s * 2.8853900817779268) + 1.0)) * cap_log2
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & kv_ok[None, :]
        if TREE:  # a draft tree's rows see the prefix and their ancestors only
            rel = (offs_n - ctx_len).to(tl.int64)
            in_chunk = (rel >= 0) & (rel < 64)
            bit = (tree_bits[:, None] >> tl.where(in_chunk, rel, 0)[None, :]) & 1
            visible = visible & ((bit != 0) | (in_chunk == 0)[None, :])
        if SLIDING:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows that have seen nothing yet keep m = -inf; shift them by 0 to avoid inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if F16_KV:
        # P rounded to the model dtype first: the same values as with a bf16 cache.
        pv = tl.dot(p.to(P_DTYPE).to(tl.float16), _quantized_to_f16(v, KV_QUANT, ASM_CVT))
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


# The split count and batch size vary step to step: runtime ints, never recompile triggers.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "attn_rows", "pf_spans", "pf_chunk",
                               "window"])
def _paged_attn_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_out_ptr, part_lse_ptr, cnt_ptr, qsl_ptr, seq_lens_ptr,
    bt_ptr, ks_ptr, vs_ptr, num_seqs, num_splits, qk_scale, stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt, stride_pt,
    stride_ph, stride_ps,
    kn_ptr, vn_ptr, pos_ptr, cs_ptr, slot_ptr, stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_cs, pf_ptr, pf_spans, pf_chunk, attn_rows, tree_ptr, window, cap_log2,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SPLIT_KV: tl.constexpr, DOT_PREC: tl.constexpr,
    KV_QUANT: tl.constexpr, USE_PDL: tl.constexpr = False, FUSE_ROPE: tl.constexpr = False,
    DECODE: tl.constexpr = False, ASM_CVT: tl.constexpr = False, PRELOAD: tl.constexpr = False,
    SHORT_CHAIN: tl.constexpr = 0, PREFETCH: tl.constexpr = 0, TREE: tl.constexpr = False,
    SLIDING: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    HEADS_FIRST: tl.constexpr = False,
):
    # PRELOAD (decode with fused RoPE, inside a CUDA graph): the metadata and the first K/V tile
    # of this program's range are read before the PDL wait, while the QKV projection still
    # runs. Both were written before the graph started (metadata by the host's copies, cached
    # positions by earlier steps); only q and the new token's k / v come from the kernel before,
    # and the new token's row of the early tile is filled in from registers after the wait.
    pdl_release(USE_PDL)
    if not PRELOAD:
        pdl_wait(USE_PDL)  # before any early return: every path waits (kernels/runtime/pdl.py)
    if HEADS_FIRST:  # a sequence's KV heads run side by side: its cache blocks read together
        pid = tl.program_id(1)
        kv_head = tl.program_id(0)
    else:
        pid = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if pid >= attn_rows:  # spare rows (PREFETCH): the next GEMVs' weights into L2, no attention
        _spare_prefetch(pf_ptr, pf_spans, pf_chunk, attn_rows, pid, kv_head, split, USE_PDL,
                        PRELOAD, PREFETCH)
        return
    if DECODE:
        # At most one query token per sequence: program pid serves sequence pid. The search
        # below is a chain of log2(num_seqs) dependent loads before the first KV load.
        s = pid
    else:
        s = _find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    q0 = 0 if DECODE else (pid - (q_start // BLOCK_Q + s)) * BLOCK_Q
    if q0 >= q_len:
        _wait_if(PRELOAD, USE_PDL)
        return
    seq_len = tl.load(seq_lens_ptr + s)
    ctx_len = seq_len - q_len

    # KV tiles this program covers: its share of [0, last visible position of the q tile].
    kv_end = ctx_len + tl.minimum(q0 + BLOCK_Q, q_len)
    n_tiles = tl.cdiv(kv_end, BLOCK_N)
    # A sliding window starts the range at the first key the tile's first row sees; tiles
    # below t_mask_lo hold keys some row of the tile no longer sees (masked).
    kv_start = ctx_len * 0
    t_mask_lo = ctx_len * 0
    if SLIDING:
        kv_start = tl.maximum(ctx_len + q0 - window + 1, 0)
        t_mask_lo = tl.cdiv(tl.maximum(kv_end - window, 0), BLOCK_N)
    tile0 = kv_start // BLOCK_N
    per_split = tl.cdiv(n_tiles - tile0, num_splits)
    t_lo = tile0 + split * per_split
    t_hi = tl.minimum(t_lo + per_split, n_tiles)
    # Splits are sized for the longest context a CUDA graph will see; a shorter one leaves the
    # trailing splits without tiles. They leave now, and the merge covers only the used ones.
    used_splits = tl.cdiv(n_tiles - tile0, per_split)
    if split >= used_splits:
        _wait_if(PRELOAD, USE_PDL)
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_q = q0 + offs_m // GROUP_P
    row_h = offs_m % GROUP_P
    row_ok = (row_q < q_len) & (row_h < GROUP)
    token = (q_start + row_q).to(tl.int64)
    head = kv_head * GROUP + row_h
    q_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    bt_row = bt_ptr + s.to(tl.int64) * stride_bt
    off_k = kv_head.to(tl.int64) * stride_kh
    off_v = kv_head.to(tl.int64) * stride_vh
    if PRELOAD:  # every cached position of the first tile; the new token's row reads 0 here
        kt0, v0 = _tile_kv(t_lo, bt_row, k_ptr, v_ptr, off_k, off_v, stride_kb, stride_ks,
                           stride_vb, stride_vs, kv_start, seq_len - 1, BLOCK_N, BLOCK_D,
                           HEAD_DIM, PAGE_SIZE, SLIDING)
        pdl_wait(USE_PDL)
    if FUSE_ROPE:  # decode: q arrives unrotated (see paged_attention's rope argument)
        pos = tl.load(pos_ptr + token, mask=row_ok, other=0)[:, None]
        q = load_rotated(q_rows, offs_d[None, :], pos, cs_ptr, stride_cs, q_mask, HEAD_DIM // 2)
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0)
    P_DTYPE: tl.constexpr = q.dtype
    # fp8 / int8 cache with a 16-bit model: products in fp16, which e4m3 converts to in one
    # instruction per pair (bf16 takes a float32 round trip) and int8 in a few integer ones;
    # stored values are exact in fp16, and so is q (bf16 with |q| < 65504).
    F16_KV: tl.constexpr = KV_QUANT != 0 and q.dtype != tl.float32
    if F16_KV:
        q = q.to(tl.float16)
    q_pos = ctx_len + row_q
    if KV_QUANT:  # scores of stored K times k_scale; read on the device (CUDA-graph safe)
        qk_scale = qk_scale * tl.load(ks_ptr)

    # Tiles before t_full are visible to every row of the q tile: no causal mask needed there.
    t_full = (ctx_len + q0 + 1) // BLOCK_N
    tree_bits = q_pos  # unread without TREE
    if TREE:  # a draft tree's rows mask the whole chunk: only the cached prefix is full
        t_full = tl.minimum(t_full, ctx_len // BLOCK_N)
        tree_bits = tl.load(tree_ptr + token, mask=row_ok, other=-1)

    if FUSE_ROPE:
        k_new, v_new = _write_own_kv(k_ptr + off_k, v_ptr + off_v, kn_ptr, vn_ptr, pos_ptr,
                                     cs_ptr, slot_ptr, ks_ptr, vs_ptr, q_start, kv_head, n_tiles,
                                     t_lo, t_hi, stride_ks, stride_vs, stride_knt, stride_knh,
                                     stride_vnt, stride_vnh, stride_cs, HEAD_DIM, BLOCK_D,
                                     KV_QUANT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first = t_lo
    if PRELOAD:
        own = tl.arange(0, BLOCK_N) + t_lo * BLOCK_N == seq_len - 1
        kt0 = tl.where(own[None, :], tl.trans(k_new), kt0)
        v0 = tl.where(own[:, None], v_new, v0)
        acc, m_i, l_i = _tile_update(acc, m_i, l_i, q, kt0, v0, t_lo, q_pos, seq_len, qk_scale,
                                     tree_bits, ctx_len, window, cap_log2, BLOCK_N, True,
                                     DOT_PREC, F16_KV, P_DTYPE, KV_QUANT, ASM_CVT, False,
                                     SLIDING, SOFTCAP)
        first = t_lo + 1
    short = False  # a split of at most SHORT_CHAIN tiles (a runtime test when SHORT_CHAIN > 0)
    if SHORT_CHAIN:
        short = t_hi - first <= SHORT_CHAIN
    if short:  # plain loads: no cp.async prologue and epilogue for one or two tiles
        for tile in tl.range(first, t_hi, num_stages=1):
            acc, m_i, l_i = _attn_tile(acc, m_i, l_i, q, tile, bt_row, k_ptr, v_ptr, off_k,
                                       off_v, stride_kb, stride_ks, stride_vb, stride_vs, q_pos,
                                       seq_len, qk_scale, tree_bits, ctx_len, kv_start, window,
                                       cap_log2, BLOCK_N, BLOCK_D, HEAD_DIM, PAGE_SIZE, True,
                                       DOT_PREC, F16_KV, P_DTYPE, KV_QUANT, ASM_CVT, TREE,
                                       SLIDING, SOFTCAP)
    else:
        if SLIDING:  # the window's lower edge
            for tile in range(first, tl.minimum(t_hi, t_mask_lo)):
                acc, m_i, l_i = _attn_tile(acc, m_i, l_i, q, tile, bt_row, k_ptr, v_ptr, off_k,
                                           off_v, stride_kb, stride_ks, stride_vb, stride_vs,
                                           q_pos, seq_len, qk_scale, tree_bits, ctx_len,
                                           kv_start, window, cap_log2, BLOCK_N, BLOCK_D,
                                           HEAD_DIM, PAGE_SIZE, True, DOT_PREC, F16_KV, P_DTYPE,
                                           KV_QUANT, ASM_CVT, TREE, SLIDING, SOFTCAP)
        for tile in range(tl.maximum(first, t_mask_lo), tl.minimum(t_hi, t_full)):
            acc, m_i, l_i = _attn_tile(acc, m_i, l_i, q, tile, bt_row, k_ptr, v_ptr, off_k,
                                       off_v, stride_kb, stride_ks, stride_vb, stride_vs, q_pos,
                                       seq_len, qk_scale, tree_bits, ctx_len, kv_start, window,
                                       cap_log2, BLOCK_N, BLOCK_D, HEAD_DIM, PAGE_SIZE, False,
                                       DOT_PREC, F16_KV, P_DTYPE, KV_QUANT, ASM_CVT, False,
                                       SLIDING, SOFTCAP)
        for tile in range(tl.maximum(tl.maximum(first, t_full), t_mask_lo), t_hi):
            acc, m_i, l_i = _attn_tile(acc, m_i, l_i, q, tile, bt_row, k_ptr, v_ptr, off_k,
                                       off_v, stride_kb, stride_ks, stride_vb, stride_vs, q_pos,
                                       seq_len, qk_scale, tree_bits, ctx_len, kv_start, window,
                                       cap_log2, BLOCK_N, BLOCK_D, HEAD_DIM, PAGE_SIZE, True,
                                       DOT_PREC, F16_KV, P_DTYPE, KV_QUANT, ASM_CVT, TREE,
                                       SLIDING, SOFTCAP)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    if KV_QUANT:  # P @ (stored V) * v_scale; linear, so split partials merge unchanged
        o = o * tl.load(vs_ptr)
    o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    if not SPLIT_KV or used_splits == 1:  # the only split: its result is the output (bit-equal)
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        p_row = token * stride_pt + head * stride_ph + split * stride_ps
        tl.store(part_out_ptr + p_row[:, None] * BLOCK_D + offs_d[None, :], o,
                 mask=row_ok[:, None])
        # Log-sum-exp in the base-2 units of the scaled scores; -inf marks an empty split.
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + p_row, lse, mask=row_ok)
        # The last split of this tile to finish merges all of them (no second launch) and
        # resets the arrival counter; every thread's stores precede the release.
        tl.debug_barrier()
        cnt = cnt_ptr + pid * tl.num_programs(1) + kv_head
        if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == used_splits - 1:
            o = _merge_splits(part_out_ptr, part_lse_ptr, token * stride_pt + head * stride_ph,
                              row_ok, offs_d, used_splits, BLOCK_M, BLOCK_D)
            tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=q_mask)
            tl.atomic_xchg(cnt, 0)


@triton.jit
def _write_own_kv(kc_head, vc_head, kn_ptr, vn_ptr, pos_ptr, cs_ptr, slot_ptr, ks_ptr, vs_ptr,
                  token, kv_head, n_tiles, t_lo, t_hi, stride_ks, stride_vs, stride_knt,
                  stride_knh, stride_vnt, stride_vnh, stride_cs, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, KV_QUANT: tl.constexpr):
    """Decode with fused RoPE: the program whose KV range holds the new token (the last tile)
    rotates its k, stores k and v into the cache, then reads them back with the tile like
    any other position (the barrier makes every thread's stores visible to the whole program).
    Only that program reads the new slot, so no other program waits for it. Returns the stored
    rows ([1, BLOCK_D], the cache dtype; zeros in every other program and for slot -1)."""
    k_new = tl.zeros([1, BLOCK_D], kc_head.dtype.element_ty)
    v_new = tl.zeros([1, BLOCK_D], vc_head.dtype.element_ty)
    if (t_lo <= n_tiles - 1) & (n_tiles - 1 < t_hi):
        slot = tl.load(slot_ptr + token).to(tl.int64)
        if slot >= 0:
            pos = tl.load(pos_ptr + token)
            k_new, v_new = store_new_kv(kn_ptr + token * stride_knt + kv_head * stride_knh,
                                        vn_ptr + token * stride_vnt + kv_head * stride_vnh,
                                        kc_head + slot * stride_ks, vc_head + slot * stride_vs,
                                        pos, cs_ptr, stride_cs, ks_ptr, vs_ptr, HEAD_DIM,
                                        HEAD_DIM // 2, BLOCK_D, KV_QUANT)
        tl.debug_barrier()
    return k_new, v_new


@triton.jit
def _spare_prefetch(pf_ptr, pf_spans, pf_chunk, attn_rows, pid, kv_head, split,
                    USE_PDL: tl.constexpr, PRELOAD: tl.constexpr, PREFETCH: tl.constexpr):
    """A spare program's L2 prefetch (kernels/attention/l2_prefetch.py), issued before the PDL
    wait while the QKV GEMV still runs (the weights are never written); PRELOAD programs wait
    here, the others waited at the top."""
    spare = ((pid - attn_rows) * tl.num_programs(1) + kv_head) * tl.num_programs(2) + split
    n_spare = (tl.num_programs(0) - attn_rows) * tl.num_programs(1) * tl.num_programs(2)
    prefetch_spans(pf_ptr, pf_spans, spare, n_spare, pf_chunk, PREFETCH)
    _wait_if(PRELOAD, USE_PDL)


@triton.jit
def _wait_if(PRELOAD: tl.constexpr, USE_PDL: tl.constexpr):
    """The PDL wait on an early return of a PRELOAD program (the others waited at the top)."""
    if PRELOAD:
        pdl_wait(USE_PDL)


@triton.jit
def _merge_splits(part_out_ptr, part_lse_ptr, base, row_ok, offs_d, num_splits,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Log-sum-exp merge over the splits of BLOCK_M rows (partials of row r at base[r] + split),
    read past L1 (other programs wrote them)."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    o = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for sp in range(0, num_splits):
        lse = tl.load(part_lse_ptr + base + sp, mask=row_ok, other=float("-inf"),
                      cache_modifier=".cg")
        part = tl.load(part_out_ptr + (base + sp)[:, None] * BLOCK_D + offs_d[None, :],
                       mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: weights 0
        alpha = tl.math.exp2(m - m_ref)
        w = tl.math.exp2(lse - m_ref)
        o = o * alpha[:, None] + part * w[:, None]
        denom = denom * alpha + w
        m = m_new
    return o / tl.where(denom == 0.0, 1.0, denom)[:, None]


@dataclass(frozen=True)
class AttnConfig:
    """Tile shape and launch parameters of one paged_attention call."""

    block_m: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    # Decode with fused RoPE only: the first K/V tile read before the PDL wait, while the QKV
    # projection still runs (the kernel's PRELOAD; choose_config sets it for split decode).
    preload: bool = False
    # Split launches: splits of at most short_chain tiles load them plainly in one loop, longer
    # ones run the staged loops (_SHORT_CHAIN_TILES).
    short_chain: int = 0
    # Launches without splits: the KV-head axis of the grid first, so the programs that run
    # together read whole cache blocks (all heads of a token) rather than one head's slice.
    heads_first: bool = False


def choose_config(meta: AttentionMetadata, num_kv_heads: int, group: int, head_dim: int,
                  device: torch.device, dtype: torch.dtype = torch.bfloat16,
                  kv_dtype: torch.dtype | None = None) -> AttnConfig:
    """Tile sizes from host ints only: small M tiles for pure decode, splits when programs are few.

    For CUDA-graph capture pass metadata whose max_seq_len is the longest context the graph
    will see: the split count is fixed at capture, and each split's range comes from the device
    seq_lens, so any count is correct and only its speed depends on this choice.
    """
    kv_dtype = kv_dtype or dtype
    group_p = triton.next_power_of_2(group)
    decode = meta.max_query_len <= 1
    block_m = max(16 if decode else 64, group_p)
    block_n = 64 if head_dim <= 128 else 32
    if dtype == torch.float32:
        # Exact float32 products run on FMAs, not tensor cores: small tiles or registers spill.
        block_m, block_n = max(16, group_p), 32
    block_q = block_m // group_p
    q_tiles = meta.num_seqs if decode else triton.cdiv(meta.num_tokens, block_q)
    programs = max(q_tiles * num_kv_heads, 1)
    target = 2 * num_sms(device)
    splits = 1
    if programs < target:
        splits = min(triton.cdiv(target, programs),
                     triton.cdiv(max(meta.max_seq_len, 1), _MIN_TOKENS_PER_SPLIT), _MAX_SPLITS)
        scratch = meta.num_tokens * num_kv_heads * group * splits * (head_dim + 1) * 4
        while splits > 1 and scratch > _MAX_SCRATCH_BYTES:
            splits //= 2
            scratch //= 2
    num_warps = 4 if block_m <= 64 else 8
    if decode and splits > 1:
        num_warps = _SPLIT_WARPS
    if decode and splits == 1 and dtype != torch.float32:
        # Many short programs (one per sequence and KV head): two warps each let more of them
        # share an SM.
        num_warps = 2
    stages = 1 if dtype == torch.float32 else 3 if decode else 2
    if decode and splits == 1 and kv_dtype.itemsize == 1 and head_dim <= 128:
        # fp8 / int8 caches (converted in registers, then through shared memory): no
        # asynchronous-copy pipeline, 32-token tiles.
        block_n, stages = 32, 1
    split_decode = decode and splits > 1
    return AttnConfig(block_m, block_n, max(splits, 1), num_warps, stages, split_decode,
                      short_chain=_SHORT_CHAIN_TILES if split_decode else 0)


@dataclass(frozen=True)
class RopeInput:
    """Pure decode with RoPE and the KV-cache write done by the attention kernel: q is passed
    unrotated, k and v ([T, Hkv, D], unrotated) are the new tokens' keys and values, stored at
    meta.slot_mapping. Same result as rotary_and_cache_write, then paged_attention."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float, *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    config: AttnConfig | None = None, rope: RopeInput | None = None,
    l2_prefetch: torch.Tensor | None = None, sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of q ([T, Hq, D]) over each sequence's paged K/V. Returns [T, Hq, D].
    meta.tree_mask (draft trees, speculative/tree.py) narrows chunk rows to their ancestors.

    Rows of q outside every sequence (padding past query_start_loc[-1]) are left unwritten,
    as in the reference. fp8 / int8 caches are read as stored * k_scale / v_scale (float32
    device scalars; None = 1.0). `config` overrides the tile choice (tests, tuning). `rope`:
    decode batches only (one query token per sequence), see RopeInput. `l2_prefetch`: a span
    table (kernels/attention/l2_spans.span_table) that a spare row of programs prefetches into L2, in
    split decode launches with `rope` (few sequences: the launch leaves SMs and HBM idle).
    `sliding_window` and `logit_softcap` as in the reference; a window's programs never read
    the block-table entries of blocks wholly before it.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    if rope is not None and meta.max_query_len > 1:
        raise ValueError("paged_attention: rope= is for decode batches (one token per sequence)")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    cfg = config or choose_config(meta, num_kv_heads, group, head_dim, q.device, q.dtype,
                                  k_cache.dtype)
    group_p = triton.next_power_of_2(group)
    block_m = max(cfg.block_m, group_p)
    block_q = block_m // group_p
    block_d = triton.next_power_of_2(max(head_dim, 16))
    splits = cfg.num_splits
    if splits > 1:
        part_out = torch.empty((num_tokens, num_heads, splits, block_d), dtype=torch.float32,
                               device=q.device)
        part_lse = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32,
                               device=q.device)
    else:
        part_out = part_lse = out  # unused by the kernel without SPLIT_KV
    # Direct indexing (program = sequence) helps many-sequence batches without splits; with
    # splits (few sequences) it was slower, so the search stays there.
    decode = meta.max_query_len <= 1 and splits == 1
    attn_rows = meta.num_seqs if decode else num_tokens // block_q + meta.num_seqs
    spare = l2_prefetch is not None and rope is not None and splits > 1 and _PF_ROWS > 0 and (
        not q.is_cuda or l2_supported(q.device))
    grid = (attn_rows + (_PF_ROWS if spare else 0), num_kv_heads, splits)
    heads_first = cfg.heads_first and decode and attn_rows < 65536  # grid axis 1 limit
    if heads_first:
        grid = (num_kv_heads, attn_rows, 1)
    cnt = _arrival_counters(q.device, attn_rows * grid[1]) if splits > 1 else out
    pf_args = (l2_prefetch, l2_prefetch.shape[0], l2_prefetch_chunk(cfg.num_warps)) if spare \
        else (out, 0, 0)
    quant, ks, vs = kv_quant_args(k_cache, v_cache, k_scale, v_scale)
    # Soft-capping takes the scores in natural units (scale / cap), then tanh(.) * cap in log2.
    qk_scale = scale / logit_softcap if logit_softcap else scale * _LOG2E
    cap_log2 = logit_softcap * _LOG2E if logit_softcap else 1.0
    rope_args = _rope_args(q, k_cache, v_cache, meta, rope)
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, out, part_out, part_lse, cnt, meta.query_start_loc, meta.seq_lens,
        meta.block_tables, ks, vs, meta.num_seqs, splits, qk_scale, q.stride(0), q.stride(1),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), meta.block_tables.stride(0),
        num_heads * splits, splits, 1, *rope_args, *pf_args, attn_rows,
        out if meta.tree_mask is None else meta.tree_mask, sliding_window or 0, cap_log2,
        GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=block_d, HEAD_DIM=head_dim, PAGE_SIZE=page_size, SPLIT_KV=splits > 1,
        DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", KV_QUANT=quant,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_kwargs(q.device),
        FUSE_ROPE=rope is not None, DECODE=decode, ASM_CVT=q.is_cuda,
        PRELOAD=cfg.preload and rope is not None, SHORT_CHAIN=cfg.short_chain,
        PREFETCH=(PF_ON if q.is_cuda else _PF_CPU_MODE) if spare else PF_OFF,
        TREE=meta.tree_mask is not None, SLIDING=bool(sliding_window),
        SOFTCAP=bool(logit_softcap), HEADS_FIRST=heads_first,
    )
    return out


def _rope_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, rope: RopeInput | None) -> tuple:
    """(k, v, positions, cos_sin, slots, k/v token and head strides, cos_sin row stride); without
    rope, q stands in for the unread tensors."""
    if rope is None:
        return (q, q, q, q, q, 0, 0, 0, 0, 0)
    check_cache(k_cache)  # the new K/V row is addressed by its flat slot
    check_cache(v_cache)
    k, v = rope.k, rope.v
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    cs = rope.cos_sin_cache
    return (k, v, rope.positions, cs, meta.slot_mapping, k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), cs.stride(0))


_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


def _arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Per-tile split arrival counters, zero between calls (the merging program resets its own).
    Sized generously up front: growing it inside a CUDA-graph capture would be unsafe."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"attention split counters ({n}) outgrew their buffer during "
                               "CUDA-graph capture; run an eager step of this size first")
        buf = torch.zeros(max(n, 1 << 17), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf
