"""Plain-PyTorch reference twins of every fused kernel: the CPU path and the test oracle.

Each Triton kernel in this package has the same signature and semantics as its twin here;
`slipstream.kernels.get_ops(device)` picks one set or the other.
Conventions: activations are [num_tokens, ...], math in float32, results in the input dtype.
"""
from __future__ import annotations

import torch

from slipstream.attention.backend import AttentionMetadata


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual; returns (rms_norm(new_residual), new_residual).

    Fast versions may reuse the storage of x and residual: callers must not read them after.
    """
    new_residual = (x.float() + residual.float()).to(x.dtype)
    return rms_norm(new_residual, weight, eps), new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> gelu(gate, approximate="tanh") * up (GeGLU)."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.gelu(gate, approximate="tanh") * up).to(x.dtype)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotation (rotate_half), as in HF Llama/Qwen. x: [T, H, D].

    cos_sin_cache: [max_positions, R] float32, cos in [:R/2] and sin in [R/2:]. R < D (partial
    rotary, Phi-4-mini): the first R dims of each head rotate, the rest pass through.
    """
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim < x.shape[-1]:
        rotated = apply_rotary(x[..., :rotary_dim], positions, cos_sin_cache)
        return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
    half = x.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions.long())
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


# 1-byte KV caches: largest magnitude each format stores (real value = stored * scale).
KV_QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def quantize_kv(x: torch.Tensor, dtype: torch.dtype,
                scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """x in the cache's element type: fp8 / int8 store x / scale clamped to the format's range
    (int8 rounded half up, the Triton kernels' rule); other dtypes a plain cast (scale unused)."""
    if dtype not in KV_QMAX:
        return x.to(dtype)
    qmax = KV_QMAX[dtype]
    y = (x.float() / (1.0 if scale is None else scale)).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.floor(y + 0.5)
    return y.to(dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """float32 values of cache entries: stored * scale for fp8 / int8, a cast otherwise."""
    if x.dtype not in KV_QMAX:
        return x.float()
    return x.float() * (1.0 if scale is None else scale)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store k, v ([T, Hkv, D]) at their flat slots; slot -1 is skipped.

    fp8 / int8 caches store k / k_scale and v / v_scale (quantize_kv; scale None = 1.0).
    """
    num_blocks, block_size = k_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slots] = quantize_kv(
        k[valid], k_cache.dtype, k_scale)
    v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slots] = quantize_kv(
        v[valid], v_cache.dtype, v_scale)


def rotary_and_cache_write(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k, store rotated k and v into the paged cache; return (q_rot, k_rot).

    The cache gets k_rot as returned (in k's dtype), quantized as in write_kv_cache.
    """
    q_rot = apply_rotary(q, positions, cos_sin_cache)
    k_rot = apply_rotary(k, positions, cos_sin_cache)
    write_kv_cache(k_rot, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return q_rot, k_rot


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    scale: float, *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None, logit_softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of q ([T, Hq, D]) over each sequence's paged K/V. Returns [T, Hq, D].

    fp8 / int8 caches are read as stored * k_scale / v_scale (dequantize_kv). `sliding_window`
    W: a query at position p sees keys at p - W + 1 .. p only, and blocks wholly before the
    window are never read (the KV manager may have freed them). `logit_softcap` c: scores
    become c * tanh(scores / c) before the mask (Gemma 2).
    """
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    qsl = meta.query_start_loc_cpu or meta.query_start_loc.tolist()
    lens = meta.seq_lens_cpu or meta.seq_lens.tolist()
    for s in range(meta.num_seqs):
        q_lo, q_hi = qsl[s], qsl[s + 1]
        if q_hi == q_lo:
            continue
        seq_len = lens[s]
        first = window_start(seq_len - (q_hi - q_lo), sliding_window) // block_size
        n_blocks = (seq_len + block_size - 1) // block_size
        blocks = meta.block_tables[s, first:n_blocks].long()
        kv_len = seq_len - first * block_size
        k = dequantize_kv(k_cache.index_select(0, blocks).flatten(0, 1)[:kv_len], k_scale)
        v = dequantize_kv(v_cache.index_select(0, blocks).flatten(0, 1)[:kv_len], v_scale)
        tree = tree_visibility(meta, q_lo, q_hi, seq_len, q.device)
        if tree is not None:
            tree = tree[:, seq_len - kv_len:]
        out[q_lo:q_hi] = _attend(q[q_lo:q_hi], k, v, seq_len, scale, tree, sliding_window,
                                 logit_softcap).to(q.dtype)
    return out


def tree_visibility(meta: AttentionMetadata, q_lo: int, q_hi: int, seq_len: int,
                    device: torch.device) -> torch.Tensor | None:
    """[Lq, seq_len] bool, False where meta.tree_mask hides a chunk position from a row (a draft
    tree's row sees the cached prefix and its ancestors); None when every row is causal."""
    if meta.tree_mask is None:
        return None
    masks = (meta.tree_mask_cpu[q_lo:q_hi] if meta.tree_mask_cpu is not None
             else meta.tree_mask[q_lo:q_hi].tolist())
    if all(m == -1 for m in masks):
        return None
    bits = torch.tensor(masks, dtype=torch.int64, device=device)
    rel = torch.arange(seq_len, device=device) - (seq_len - (q_hi - q_lo))
    in_chunk = (rel >= 0) & (rel < 64)
    bit = (bits[:, None] >> rel.clamp(0, 63)[None, :]) & 1
    return (bit != 0) | ~in_chunk[None, :]


def window_start(first_query_pos: int, sliding_window: int | None) -> int:
    """The first key position any query at or after `first_query_pos` can see."""
    return 0 if not sliding_window else max(0, first_query_pos - sliding_window + 1)


def softcap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(scores / cap) (Gemma 2's attention and final-logit soft-capping)."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, scale: float,
            visible: torch.Tensor | None = None, sliding_window: int | None = None,
            logit_softcap: float | None = None):
    """q [Lq, Hq, D] at the last Lq positions of a sequence of seq_len tokens; k/v [L, Hkv, D]
    its last L keys and values; GQA by head groups. visible: [Lq, L] bool narrowing the causal
    mask (draft trees)."""
    lq, hq, _ = q.shape
    group = hq // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = softcap(torch.einsum("qhd,khd->hqk", q.float(), kf) * scale, logit_softcap)
    q_pos = torch.arange(seq_len - lq, seq_len, device=q.device).unsqueeze(1)
    k_pos = torch.arange(seq_len - k.shape[0], seq_len, device=q.device).unsqueeze(0)
    hidden = k_pos > q_pos
    if sliding_window:
        hidden |= k_pos <= q_pos - sliding_window
    if visible is not None:
        hidden |= ~visible
    scores = scores.masked_fill(hidden.unsqueeze(0), float("-inf"))
    probs = scores.softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, vf)
