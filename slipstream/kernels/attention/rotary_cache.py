"""Triton NeoX rotary embedding and paged KV-cache writes, separately or fused in one pass.

Same semantics as apply_rotary / write_kv_cache / rotary_and_cache_write in kernels/reference.py:
cos_sin_cache is [max_positions, D] float32 (cos | sin halves), caches are
[num_blocks, block_size, num_kv_heads, head_dim], slot -1 is skipped. One program per token.
fp8 / int8 caches store x / scale (one float32 scale per layer for K and one for V).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels import reference
from slipstream.kernels.runtime import pdl
from slipstream.kernels.runtime.pdl import pdl_release, pdl_wait

# KV_QUANT constexpr: how values reach the cache (0: a cast, 1: fp8 e4m3, 2: int8); the
# clamp limits below are kernels.reference.KV_QMAX.
_KV_QUANT = {torch.float8_e4m3fn: 1, torch.int8: 2}


@triton.jit
def round_e4m3(y):
    """y (float32, |y| <= 448) rounded to the nearest e4m3 value, ties to even, in exact float32
    steps: the cast to fp8 after it is exact, so the GPU and Triton's interpreter (whose fp32 ->
    fp8 cast mis-rounds at binade edges) store the same bits as torch's cast."""
    bits = y.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    # Spacing of e4m3 values around y: 2^(e-3) for normals, 2^-9 below 2^-6 (subnormals).
    q = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    z = tl.abs(y) / q
    f = tl.floor(z)
    frac = z - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    r = (f + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)) * q
    return tl.where(bits < 0, -r, r)


@triton.jit
def _quantize(x, scale, KV_QUANT: tl.constexpr):
    """Values to store for x in a KV_QUANT cache (float32 x / scale, clamped; fp8 rounded to
    nearest even, int8 half up), or x itself for a plain cache. = quantize_kv (reference)."""
    if KV_QUANT == 1:
        return round_e4m3(tl.minimum(tl.maximum(x.to(tl.float32) / scale, -448.0), 448.0))
    elif KV_QUANT == 2:
        y = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -127.0), 127.0)
        return tl.floor(y + 0.5)
    else:
        return x


@triton.jit
def _load_scale(scale_ptr, KV_QUANT: tl.constexpr):
    # Read on the device: the scale may change after a CUDA graph captured this launch.
    if KV_QUANT != 0:
        return tl.load(scale_ptr)
    else:
        return 1.0


@triton.jit
def _rotate_heads(src, stride_h, n_heads, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    """Load [heads, D] of one token from src and return its two rotated halves (float32)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < n_heads) & (d < HALF)
    ptrs = src + h * stride_h + d
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _store_halves(dst, stride_h, n_heads, y1, y2, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < n_heads) & (d < HALF)
    ptrs = dst + h * stride_h + d
    tl.store(ptrs, y1.to(dst.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, y2.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _load_cos_sin(pos_ptr, cs_ptr, stride_cs, t, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    mask = d < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + d, mask=mask, other=0.0)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d, mask=mask, other=0.0)[None, :]
    return cos, sin


@triton.jit
def _copy_heads(src, stride_h, dst, dst_stride_h, n_heads, scale, HEAD_DIM: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_QUANT: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < n_heads) & (d < HEAD_DIM)
    x = _quantize(tl.load(src + h * stride_h + d, mask=mask, other=0.0), scale, KV_QUANT)
    tl.store(dst + h * dst_stride_h + d, x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def load_rotated(row_ptrs, offs_d, pos, cs_ptr, stride_cs, mask, HALF: tl.constexpr):
    """Rows at row_ptrs (+ offs_d), rotated (rotate_half) at positions pos and rounded to their
    dtype, as _rope_cache_kernel stores them: each element and its partner half are loaded, so
    any [rows, D] tile works (the attention kernel rotates q as it loads it)."""
    first = offs_d < HALF
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)
    c = tl.where(first, offs_d, offs_d - HALF)
    x = tl.load(row_ptrs + offs_d, mask=mask, other=0.0)
    xp = tl.load(row_ptrs + partner, mask=mask, other=0.0).to(tl.float32)
    cs = cs_ptr + pos.to(tl.int64) * stride_cs
    cos = tl.load(cs + c, mask=mask, other=0.0)
    sin = tl.load(cs + HALF + c, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    y = tl.where(first, xf * cos - xp * sin, xf * cos + xp * sin)
    return y.to(x.dtype)


@triton.jit
def store_new_kv(k_row, v_row, kc_row, vc_row, pos, cs_ptr, stride_cs, ks_ptr, vs_ptr,
                 HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                 KV_QUANT: tl.constexpr):
    """One token's k (rotated at pos) and v rows of one KV head into their cache rows, quantized
    for an fp8 / int8 cache exactly as _rope_cache_kernel does. Returns the stored rows
    ([1, BLOCK_D] each, in the cache dtype)."""
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = d < HEAD_DIM
    k = load_rotated(k_row, d, pos, cs_ptr, stride_cs, mask, HALF)
    k = _quantize(k, _load_scale(ks_ptr, KV_QUANT), KV_QUANT).to(kc_row.dtype.element_ty)
    tl.store(kc_row + d, k, mask=mask)
    v = _quantize(tl.load(v_row + d, mask=mask, other=0.0), _load_scale(vs_ptr, KV_QUANT),
                  KV_QUANT).to(vc_row.dtype.element_ty)
    tl.store(vc_row + d, v, mask=mask)
    return k, v


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, cs_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh,
                 stride_cs, n_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _load_cos_sin(pos_ptr, cs_ptr, stride_cs, t, HALF, BLOCK_HALF)
    y1, y2 = _rotate_heads(x_ptr + t * stride_xt, stride_xh, n_heads, cos, sin, HALF, BLOCK_H,
                           BLOCK_HALF)
    _store_halves(out_ptr + t * stride_ot, stride_oh, n_heads, y1, y2, HALF, BLOCK_H, BLOCK_HALF)


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, stride_kt,
                     stride_kh, stride_vt, stride_vh, stride_kc_slot, stride_kc_h, stride_vc_slot,
                     stride_vc_h, n_kv_heads, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, KV_QUANT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        _copy_heads(k_ptr + t * stride_kt, stride_kh, kc_ptr + slot * stride_kc_slot, stride_kc_h,
                    n_kv_heads, _load_scale(ks_ptr, KV_QUANT), HEAD_DIM, BLOCK_H, BLOCK_D,
                    KV_QUANT)
        _copy_heads(v_ptr + t * stride_vt, stride_vh, vc_ptr + slot * stride_vc_slot, stride_vc_h,
                    n_kv_heads, _load_scale(vs_ptr, KV_QUANT), HEAD_DIM, BLOCK_H, BLOCK_D,
                    KV_QUANT)


@triton.jit
def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, q_out_ptr, k_out_ptr, kc_ptr, vc_ptr,
                       slot_ptr, ks_ptr, vs_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                       stride_vt, stride_vh, stride_qot, stride_qoh, stride_kot, stride_koh,
                       stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h, stride_cs,
                       n_q_heads, n_kv_heads,
                       HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
                       BLOCK_HALF: tl.constexpr, KV_QUANT: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cos, sin = _load_cos_sin(pos_ptr, cs_ptr, stride_cs, t, HALF, BLOCK_HALF)
    q1, q2 = _rotate_heads(q_ptr + t * stride_qt, stride_qh, n_q_heads, cos, sin, HALF, BLOCK_HQ,
                           BLOCK_HALF)
    _store_halves(q_out_ptr + t * stride_qot, stride_qoh, n_q_heads, q1, q2, HALF, BLOCK_HQ,
                  BLOCK_HALF)
    k1, k2 = _rotate_heads(k_ptr + t * stride_kt, stride_kh, n_kv_heads, cos, sin, HALF,
                           BLOCK_HKV, BLOCK_HALF)
    # Round to the activation dtype first so the cache holds exactly the returned k_rot.
    k1 = k1.to(k_out_ptr.dtype.element_ty)
    k2 = k2.to(k_out_ptr.dtype.element_ty)
    _store_halves(k_out_ptr + t * stride_kot, stride_koh, n_kv_heads, k1, k2, HALF, BLOCK_HKV,
                  BLOCK_HALF)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        ks = _load_scale(ks_ptr, KV_QUANT)
        _store_halves(kc_ptr + slot * stride_kc_slot, stride_kc_h, n_kv_heads,
                      _quantize(k1, ks, KV_QUANT), _quantize(k2, ks, KV_QUANT), HALF, BLOCK_HKV,
                      BLOCK_HALF)
        _copy_heads(v_ptr + t * stride_vt, stride_vh, vc_ptr + slot * stride_vc_slot, stride_vc_h,
                    n_kv_heads, _load_scale(vs_ptr, KV_QUANT), 2 * HALF, BLOCK_HKV,
                    2 * BLOCK_HALF, KV_QUANT)


def check_cache(cache: torch.Tensor) -> None:
    # Flat slot addressing needs blocks and rows laid out back to back, unit stride on head_dim.
    if cache.stride(0) != cache.shape[1] * cache.stride(1) or cache.stride(3) != 1:
        raise ValueError("KV cache must be contiguous in its block and head_dim dims")


def _heads_view(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] with unit stride on D (copied only when needed)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _block(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def kv_quant_args(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
              v_scale: torch.Tensor | None):
    """(KV_QUANT, k scale arg, v scale arg) of a kernel launch: device float32 scales for an
    fp8 / int8 cache (None -> 1.0); for a plain cache the caches stand in as unread pointers."""
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ ({k_cache.dtype}, {v_cache.dtype})")
    mode = _KV_QUANT.get(k_cache.dtype, 0)
    if mode == 0:
        return 0, k_cache, v_cache

    def dev(s: torch.Tensor | None) -> torch.Tensor:
        if s is None:
            return torch.ones((), dtype=torch.float32, device=k_cache.device)
        return s if s.dtype == torch.float32 else s.float()

    return mode, dev(k_scale), dev(v_scale)


def is_partial_rotary(x: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
    """Whether the table rotates only the first dims of each head: the kernels here rotate
    whole heads, so such a model takes the reference rotation (kernels/reference.py)."""
    return cos_sin_cache.shape[-1] != x.shape[-1]


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotation (rotate_half) of x [T, H, D] at `positions`."""
    if is_partial_rotary(x, cos_sin_cache):
        return reference.apply_rotary(x, positions, cos_sin_cache)
    x = _heads_view(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_tokens, n_heads, head_dim = x.shape
    if num_tokens == 0:
        return out
    half = head_dim // 2
    _rope_kernel[(num_tokens,)](
        x, positions, cos_sin_cache, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        cos_sin_cache.stride(0), n_heads, HALF=half, BLOCK_H=_block(n_heads),
        BLOCK_HALF=_block(half), num_warps=4,
    )
    return out


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store k, v ([T, Hkv, D]) at their flat slots; slot -1 is skipped.

    fp8 / int8 caches store k / k_scale and v / v_scale (device scalars; None = 1.0).
    """
    check_cache(k_cache)
    check_cache(v_cache)
    k, v = _heads_view(k), _heads_view(v)
    num_tokens, n_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    mode, ks, vs = kv_quant_args(k_cache, v_cache, k_scale, v_scale)
    _kv_write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, ks, vs, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        n_kv_heads, HEAD_DIM=head_dim, BLOCK_H=_block(n_kv_heads), BLOCK_D=_block(head_dim),
        KV_QUANT=mode, num_warps=4,
    )


def rotary_and_cache_write(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k, store rotated k and v into the paged cache; return (q_rot, k_rot).

    q, k, v may be strided views (e.g. slices of the fused QKV output); one program per token.
    fp8 / int8 caches get k_rot / k_scale and v / v_scale, as in write_kv_cache.
    A table narrower than the head (partial rotary) rotates with torch ops, then writes.
    """
    if is_partial_rotary(q, cos_sin_cache):
        q_rot = reference.apply_rotary(q, positions, cos_sin_cache)
        k_rot = reference.apply_rotary(k, positions, cos_sin_cache)
        write_kv_cache(k_rot, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return q_rot, k_rot
    check_cache(k_cache)
    check_cache(v_cache)
    q, k, v = _heads_view(q), _heads_view(k), _heads_view(v)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_tokens, n_q_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    mode, ks, vs = kv_quant_args(k_cache, v_cache, k_scale, v_scale)
    _rope_cache_kernel[(num_tokens,)](
        q, k, v, positions, cos_sin_cache, q_out, k_out, k_cache, v_cache, slot_mapping, ks, vs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        cos_sin_cache.stride(0), n_q_heads, n_kv_heads, HALF=half, BLOCK_HQ=_block(n_q_heads),
        BLOCK_HKV=_block(n_kv_heads), BLOCK_HALF=_block(half), KV_QUANT=mode, num_warps=4,
        **pdl.launch_kwargs(q.device),
    )
    return q_out, k_out
