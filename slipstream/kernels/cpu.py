"""The CPU kernel table: the reference twins (kernels/reference.py) with a faster paged attention.

reference.paged_attention stays the simple oracle the Triton kernels are tested against: one
Python iteration per sequence, GQA by repeat_interleave, einsum and softmax in float32. On a CPU
that loop is most of a batched decode step (32 sequences x 30 layers of small ops). Here:

- decode sequences (one query token each) attend in one batched scaled_dot_product_attention
  over K/V gathered with one index_select per layer, padded to the longest sequence and masked;
- the gather indices and the mask are built once per step (cached on the step's metadata) and
  reused by every layer;
- a sequence with several query tokens (a prefill chunk) gets one SDPA call of its own (causal,
  bottom-right aligned when it has a cached prefix).

A sliding-window layer gathers only the blocks its window reaches (a plan per window size) and
masks the rest of the first one; attention-logit soft-capping (Gemma 2), which SDPA cannot
apply, runs the oracle itself.

Math in float32 as in the oracle (fp8 / int8 caches dequantized the same way); results equal the
oracle's to float32 rounding (tests/kernels/attention/test_cpu_paged.py).

RMSNorm and SiLU-and-mul of float32 tensors skip the oracle's casts and temporaries (a batch-1
step runs ~60 norms, each a handful of tiny ops where dispatch is the cost); same operations in
the same order, so bit-identical (tests/kernels/test_cpu_ops.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from slipstream.attention.backend import AttentionMetadata
from slipstream.kernels import OP_NAMES, reference

_PLAN_ATTR = "_cpu_attention_plan"


@dataclass
class _Plan:
    """Per-step gather plan, shared by every layer of the step."""

    block_size: int
    window: int | None
    # Decode sequences (query length 1): their query rows, flat K/V slots [Sd, Lmax] and mask.
    dec_rows: torch.Tensor | None
    dec_rows_identity: bool  # rows 0..Sd-1 in order: no gather / scatter of q and out
    dec_slots: torch.Tensor | None  # [Sd * Lmax] int64
    dec_mask: torch.Tensor | None  # [Sd, 1, 1, Lmax] bool, True = attend; None: no padding
    dec_len: int
    # Other sequences: (q_lo, q_hi, seq_len, first block, block ids [n_blocks] int64).
    others: list[tuple[int, int, int, int, torch.Tensor]]


def _build_plan(meta: AttentionMetadata, block_size: int, device: torch.device,
                window: int | None) -> _Plan:
    qsl = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    dec_seqs, dec_rows, others = [], [], []
    for s in range(meta.num_seqs):
        q_lo, q_hi = qsl[s], qsl[s + 1]
        if q_hi == q_lo:
            continue
        if q_hi - q_lo == 1:
            dec_seqs.append(s)
            dec_rows.append(q_lo)
        else:
            first = reference.window_start(lens[s] - (q_hi - q_lo), window) // block_size
            n_blocks = (lens[s] + block_size - 1) // block_size
            others.append((q_lo, q_hi, lens[s], first,
                           meta.block_tables[s, first:n_blocks].long()))
    if not dec_seqs:
        return _Plan(block_size, window, None, False, None, None, 0, others)
    # Each decode sequence's K/V from the first block its window reaches (0 without a window).
    firsts = [reference.window_start(lens[s] - 1, window) // block_size for s in dec_seqs]
    dec_lens = [lens[s] - f * block_size for s, f in zip(dec_seqs, firsts)]
    max_len = max(dec_lens)
    n_blocks = (max_len + block_size - 1) // block_size
    seqs = torch.tensor(dec_seqs, dtype=torch.long, device=device)
    cols = torch.tensor(firsts, device=device).unsqueeze(1) + torch.arange(n_blocks, device=device)
    cols = cols.clamp_(max=meta.block_tables.shape[1] - 1)
    tables = meta.block_tables.index_select(0, seqs).gather(1, cols).long()  # [Sd, nb]
    pos = torch.arange(n_blocks * block_size, device=device)
    slots = (tables * block_size).repeat_interleave(block_size, dim=1) + pos % block_size
    slots = slots[:, :max_len]
    lens_t = torch.tensor(dec_lens, device=device).unsqueeze(1)
    valid = pos[:max_len].unsqueeze(0) < lens_t
    if window:  # the first block's keys before the window
        valid &= pos[:max_len].unsqueeze(0) > lens_t - 1 - window
    mask = None
    if min(dec_lens) != max_len or (window and max_len > window):
        slots = slots.masked_fill(~valid, 0)
        mask = valid[:, None, None, :]
    identity = dec_rows == list(range(len(dec_rows)))
    return _Plan(block_size, window, torch.tensor(dec_rows, dtype=torch.long, device=device),
                 identity, slots.reshape(-1).contiguous(), mask, max_len, others)


def _plan_for(meta: AttentionMetadata, block_size: int, device: torch.device,
              window: int | None) -> _Plan:
    """The step's plan for this window size (Gemma's local and global layers share a step)."""
    plans = meta.__dict__.setdefault(_PLAN_ATTR, {})
    plan = plans.get(window)
    if plan is None or plan.block_size != block_size:
        plan = plans[window] = _build_plan(meta, block_size, device, window)
    return plan


def _as_float(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return x if x.dtype == torch.float32 and scale is None else reference.dequantize_kv(x, scale)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float, *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None, logit_softcap: float | None = None,
) -> torch.Tensor:
    """Same contract as reference.paged_attention: q [T, Hq, D] -> [T, Hq, D]."""
    if logit_softcap is not None:
        return reference.paged_attention(q, k_cache, v_cache, meta, scale, k_scale=k_scale,
                                          v_scale=v_scale, sliding_window=sliding_window,
                                          logit_softcap=logit_softcap)
    num_blocks, block_size, hkv, d = k_cache.shape
    plan = _plan_for(meta, block_size, q.device, sliding_window or None)
    hq = q.shape[1]
    gqa = hq != hkv
    out = torch.empty_like(q) if plan.others or not plan.dec_rows_identity \
        or plan.dec_rows is None or plan.dec_rows.numel() != q.shape[0] else None
    k_flat = k_cache.view(num_blocks * block_size, hkv, d)
    v_flat = v_cache.view(num_blocks * block_size, hkv, d)
    if plan.dec_rows is not None:
        sd = plan.dec_rows.numel()
        qd = q[:sd] if plan.dec_rows_identity else q.index_select(0, plan.dec_rows)
        qd = qd.float().unsqueeze(2)  # [Sd, Hq, 1, D]
        k = _as_float(k_flat.index_select(0, plan.dec_slots), k_scale)
        v = _as_float(v_flat.index_select(0, plan.dec_slots), v_scale)
        k = k.view(sd, plan.dec_len, hkv, d).transpose(1, 2)  # [Sd, Hkv, L, D]
        v = v.view(sd, plan.dec_len, hkv, d).transpose(1, 2)
        res = F.scaled_dot_product_attention(qd, k, v, attn_mask=plan.dec_mask, scale=scale,
                                             enable_gqa=gqa).squeeze(2).to(q.dtype)
        if out is None:
            return res
        if plan.dec_rows_identity:
            out[:sd] = res
        else:
            out.index_copy_(0, plan.dec_rows, res)
    for q_lo, q_hi, seq_len, first, blocks in plan.others:
        lq, kv_len = q_hi - q_lo, seq_len - first * block_size
        k = _as_float(k_cache.index_select(0, blocks).flatten(0, 1)[:kv_len], k_scale)
        v = _as_float(v_cache.index_select(0, blocks).flatten(0, 1)[:kv_len], v_scale)
        qs = q[q_lo:q_hi].float().transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
        ks, vs = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        tree = reference.tree_visibility(meta, q_lo, q_hi, seq_len, q.device)
        if lq == seq_len and tree is None and not plan.window:
            res = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                 enable_gqa=gqa)
        else:  # queries at the last lq positions: bottom-right causal mask, window, draft tree
            q_pos = torch.arange(seq_len - lq, seq_len, device=q.device).unsqueeze(1)
            k_pos = torch.arange(seq_len - kv_len, seq_len, device=q.device).unsqueeze(0)
            mask = k_pos <= q_pos
            if plan.window:
                mask &= k_pos > q_pos - plan.window
            if tree is not None:
                mask &= tree[:, seq_len - kv_len:]
            res = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                 enable_gqa=gqa)
        out[q_lo:q_hi] = res.squeeze(0).transpose(0, 1).to(q.dtype)
    return out


def _all_float32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """reference.rms_norm."""
    if not _all_float32(x, weight):
        return reference.rms_norm(x, weight, eps)
    inv_rms = x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return (x * inv_rms).mul_(weight)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.fused_add_rms_norm."""
    if not _all_float32(x, residual, weight):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """reference.silu_and_mul."""
    if not _all_float32(x):
        return reference.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def cpu_ops() -> SimpleNamespace:
    """The CPU table: the reference twins, with the batched paged_attention and the float32
    norm and activation paths above."""
    ops = {name: getattr(reference, name) for name in OP_NAMES}
    fast = {"paged_attention": paged_attention, "rms_norm": rms_norm,
            "fused_add_rms_norm": fused_add_rms_norm, "silu_and_mul": silu_and_mul}
    return SimpleNamespace(**{**ops, **fast}, name="cpu")
