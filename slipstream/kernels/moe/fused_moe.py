"""Fused MoE in Triton: routing, then the experts' gated MLPs, with a twin in reference.py.

Two paths, the same result:
- Grouped GEMM (any batch): the (token, slot) pairs are sorted by expert into blocks of
  BLOCK_M rows (reference.align_by_expert, torch ops with no host read); one launch computes
  [gate | up] of every block with its expert's weight and writes SiLU(gate) * up, a second the
  down projection times the routing weight; the k slots of a token are summed last. Blocks
  past the rows in use exit at once, so the grid size depends on the shapes only (CUDA graphs).
- Decode (a few tokens): no sort at all. One program per (pair, column tile) reads the pair's
  expert id and streams only that expert's rows of [gate | up], then one per (pair, tile) its
  down rows; the last of a token's k down programs to finish a tile sums the k partial rows in
  slot order. Only the selected experts' weights are read.

Weights are 16-bit, or int8 / fp8 with a float32 scale per output row (weight-only: the tiles
are converted to the activation dtype before the product, the scale applied after it), or int4
(reference.Int4Experts: two values a byte along K, a scale and a zero per group of K): each tile
is unpacked and dequantized in registers, (q - zero) * scale of its group, before the product.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.kernels.gemv.dense import counters, reduce_splits
from slipstream.kernels.moe.reference import Int4Experts, align_by_expert


@triton.jit
def _route_topk_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l,
                       TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_TOPK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    logits = tl.load(logits_ptr + token * stride_l + offs, mask=valid,
                     other=float("-inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = tl.where(valid, probs, 0.0)
    probs = probs / tl.sum(probs, axis=0)
    probs = tl.where(valid, probs, -1.0)
    slots = tl.arange(0, BLOCK_TOPK)
    chosen_w = tl.zeros([BLOCK_TOPK], dtype=tl.float32)
    chosen_id = tl.zeros([BLOCK_TOPK], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        index = tl.min(tl.where(probs == best, offs, BLOCK_E), axis=0)  # ties: lowest id
        chosen_w = tl.where(slots == j, best, chosen_w)
        chosen_id = tl.where(slots == j, index, chosen_id)
        probs = tl.where(offs == index, -1.0, probs)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.sum(tl.where(slots < TOP_K, chosen_w, 0.0), axis=0)
    tl.store(weights_ptr + token * TOP_K + slots, chosen_w, mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, chosen_id, mask=slots < TOP_K)


def route_topk(logits: torch.Tensor, top_k: int, renormalize: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """reference.route_topk in one kernel: softmax, top-k, optional renormalisation."""
    num_tokens, num_experts = logits.shape
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds the {num_experts} experts")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens:
        _route_topk_kernel[(num_tokens,)](
            logits, weights, ids, num_experts, logits.stride(0), TOP_K=top_k,
            RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_TOPK=triton.next_power_of_2(top_k), num_warps=1)
    return weights, ids


@triton.jit
def _int4_tile(w_ptr, s_ptr, z_ptr, n, k, mask, stride_wn, stride_sn, GROUP: tl.constexpr):
    """float32 weights at (row n, column k) of one expert's packed int4 matrix: nibble k % 2
    of byte k // 2, (q - zero) * scale of k's group. n (int64) and k broadcast to the tile."""
    byte = tl.load(w_ptr + n * stride_wn + k // 2, mask=mask, other=0).to(tl.int32)
    q = ((byte >> ((k % 2) * 4)) & 0xF).to(tl.float32)
    g = n * stride_sn + k // GROUP
    zero = tl.load(z_ptr + g, mask=mask, other=0).to(tl.float32)
    return (q - zero) * tl.load(s_ptr + g, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, scale_ptr, zero_ptr, topk_w_ptr, sorted_ptr,
                     block_expert_ptr, num_padded_ptr, N, K, num_pairs,
                     stride_am, stride_be, stride_bn, stride_cm, stride_se, stride_sn,
                     A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                     HAS_SCALE: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """C[pair, n] for the rows of one expert block. GATED: B = [gate | up] (2N rows), C gets
    silu(gate) * up. A's row of a pair is pair // A_ROW_DIV (the token for the first GEMM)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + offs_m)
    row_ok = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn \
        + offs_k[:, None]
    # int4: the expert's packed weight, scales and zeros; columns n of this tile as int64
    b_base = b_ptr + expert * stride_be
    s_base = scale_ptr + expert * stride_se
    z_base = zero_ptr + expert * stride_se
    n_col = offs_n[None, :].to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        b_mask = k_ok[:, None] & n_ok[None, :]
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if INT4:
            k_row = (k0 + offs_k)[:, None]
            b = _int4_tile(b_base, s_base, z_base, n_col, k_row, b_mask, stride_bn, stride_sn,
                           GROUP)
        else:
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
        if GATED:
            if INT4:
                u = _int4_tile(b_base, s_base, z_base, n_col + N, k_row, b_mask, stride_bn,
                               stride_sn, GROUP)
            else:
                u = tl.load(b_ptrs + N * stride_bn, mask=b_mask, other=0.0)
            acc_up = tl.dot(a, u.to(a.dtype), acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_SCALE:
        scale_row = scale_ptr + expert * stride_se
        acc *= tl.load(scale_row + offs_n, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(scale_row + N + offs_n, mask=n_ok, other=0.0)[None, :]
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        acc *= tl.load(topk_w_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_gate_up_gemv_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, ids_ptr, act_ptr, N, K,
                             stride_xm, stride_we, stride_wn, stride_am, stride_se, stride_sn,
                             TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, INT4: tl.constexpr,
                             GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """act[pair, n] = silu(gate_e(x_t)) * up_e(x_t) on one column tile, e = ids[pair]."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    if expert < 0:
        return
    token = (pair // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn \
        + offs_k[None, :]
    u_ptrs = g_ptrs + N * stride_wn
    x_ptrs = x_ptr + token * stride_xm + offs_k
    w_base = w_ptr + expert * stride_we
    s_base = scale_ptr + expert * stride_se
    z_base = zero_ptr + expert * stride_se
    n_row = offs_n[:, None].to(tl.int64)
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        x = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = n_ok[:, None] & k_ok[None, :]
        if INT4:
            k_col = (k0 + offs_k)[None, :]
            g = _int4_tile(w_base, s_base, z_base, n_row, k_col, mask, stride_wn, stride_sn,
                           GROUP)
            u = _int4_tile(w_base, s_base, z_base, n_row + N, k_col, mask, stride_wn,
                           stride_sn, GROUP)
            # the activation dtype's rounding of the weight, as the reference's
            acc_g += g.to(x_ptr.dtype.element_ty).to(tl.float32) * x
            acc_u += u.to(x_ptr.dtype.element_ty).to(tl.float32) * x
        else:
            acc_g += tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32) * x
            acc_u += tl.load(u_ptrs, mask=mask, other=0.0).to(tl.float32) * x
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    gate = tl.sum(acc_g, axis=1)
    up = tl.sum(acc_u, axis=1)
    if HAS_SCALE:
        gate *= tl.load(scale_ptr + expert * stride_se + offs_n, mask=n_ok, other=0.0)
        up *= tl.load(scale_ptr + expert * stride_se + N + offs_n, mask=n_ok, other=0.0)
    act = gate * tl.sigmoid(gate) * up
    tl.store(act_ptr + pair.to(tl.int64) * stride_am + offs_n, act.to(act_ptr.dtype.element_ty),
             mask=n_ok)


@triton.jit
def _moe_down_gemv_kernel(act_ptr, w_ptr, scale_ptr, zero_ptr, ids_ptr, topk_w_ptr, part_ptr,
                          out_ptr, cnt_ptr, N, K, stride_am, stride_we, stride_wn, stride_pm,
                          stride_om, stride_se, stride_sn, TOP_K: tl.constexpr,
                          HAS_SCALE: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """part[pair, n] = weight[pair] * down_e(act[pair]) (float32) on one column tile: one
    program per (pair, tile), so a token's experts stream their weights side by side. The last
    of a token's k programs on a tile to arrive on its counter (cnt_ptr, [tokens, tiles], left
    at zero) sums the k partial rows in slot order (the same bits, run to run: no float
    atomics) and writes out[token] in out's dtype: no separate sum launch."""
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    part = tl.zeros([BLOCK_N], dtype=tl.float32)
    if expert >= 0:  # a slot held elsewhere (expert parallelism) adds nothing
        part = tl.load(topk_w_ptr + pair) * _down_rows(
            act_ptr + pair.to(tl.int64) * stride_am, w_ptr + expert * stride_we,
            scale_ptr + expert * stride_se, zero_ptr + expert * stride_se, offs_n, n_ok, K,
            stride_wn, stride_sn, HAS_SCALE, INT4, GROUP, BLOCK_N, BLOCK_K)
    token = pair // TOP_K
    rows = part_ptr + (token * TOP_K).to(tl.int64) * stride_pm + offs_n
    total, done = reduce_splits(part, rows, n_ok, stride_pm,
                                cnt_ptr + token * tl.num_programs(1) + pid_n, pair % TOP_K,
                                TOP_K, True)
    if done:
        tl.store(out_ptr + token.to(tl.int64) * stride_om + offs_n,
                 total.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_rows(a_ptr, w_base, s_base, z_base, offs_n, n_ok, K, stride_wn, stride_sn,
               HAS_SCALE: tl.constexpr, INT4: tl.constexpr, GROUP: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """down_e(act) on rows offs_n of one expert's weight (w_base), float32 [BLOCK_N]."""
    offs_k = tl.arange(0, BLOCK_K)
    n_row = offs_n[:, None].to(tl.int64)
    w_ptrs = w_base + n_row * stride_wn + offs_k[None, :]
    a_ptrs = a_ptr + offs_k
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        mask = n_ok[:, None] & k_ok[None, :]
        if INT4:
            w = _int4_tile(w_base, s_base, z_base, n_row, (k0 + offs_k)[None, :], mask,
                           stride_wn, stride_sn, GROUP).to(a_ptr.dtype.element_ty)
        else:
            w = tl.load(w_ptrs, mask=mask, other=0.0)
        acc += w.to(tl.float32) * a
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    part = tl.sum(acc, axis=1)
    if HAS_SCALE:
        part *= tl.load(s_base + offs_n, mask=n_ok, other=0.0)
    return part


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of the grouped GEMM path."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of the decode path (block_n rows of a weight by block_k columns a step)."""

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4



def gemm_config(num_pairs: int, num_experts: int) -> GemmConfig:
    """Rows per block near the mean pairs per expert: few tokens waste little padding, many
    get the bigger tiles."""
    per_expert = num_pairs / max(num_experts, 1)
    if per_expert <= 16:
        return GemmConfig(16, 64, 64, 4, 3)
    if per_expert <= 64:
        return GemmConfig(32, 64, 64, 4, 3)
    return GemmConfig(64, 128, 64, 8, 3)


def gemv_config(rows: int, n: int, weight: torch.Tensor) -> GemvConfig:
    """block_n as large as keeps ~512 programs in flight (enough to saturate memory);
    block_k covers 512 bytes of a weight row a step (int4, packed uint8: 512 values, 256
    bytes)."""
    block_k = 512 // weight.element_size()
    block_n = 64
    while block_n > 4 and rows * triton.cdiv(n, block_n) < 512:
        block_n //= 2
    return GemvConfig(block_n, block_k, 4)


def use_decode_path(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Few tokens: the per-pair GEMVs, while pairs rarely share an expert (a shared one is read
    once per pair); the grouped GEMM reads each expert once per block."""
    return num_tokens <= max(1, num_experts // (2 * top_k))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, int4: Int4Experts | None = None, *,
              decode: bool | None = None, gemm: GemmConfig | None = None,
              gemv: GemvConfig | None = None) -> torch.Tensor:
    """reference.fused_moe with the Triton kernels. decode: force one path (None: by size)."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    _check_shapes(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, int4)
    if num_tokens == 0:
        return x.new_empty(0, w2.shape[1])
    x = x.contiguous()
    topk_weights = topk_weights.float().contiguous()
    topk_ids = topk_ids.to(torch.int32).contiguous()
    if decode is None:
        decode = use_decode_path(num_tokens, top_k, num_experts)
    weights = (_Weights(w13, w13_scale, int4 and int4.w13_zero, int4),
               _Weights(w2, w2_scale, int4 and int4.w2_zero, int4))
    if decode:
        return _decode(x, *weights, topk_weights, topk_ids, gemv)
    return _grouped(x, *weights, topk_weights, topk_ids, gemm)


def _check_shapes(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, int4) -> None:
    pack = 1 if int4 is None else 2
    num_experts, two_i, hidden = w13.shape
    hidden *= pack
    ok = (x.dim() == 2 and x.shape[1] == hidden and two_i % 2 == 0
          and tuple(w2.shape) == (num_experts, hidden, two_i // 2 // pack)
          and topk_weights.shape == topk_ids.shape and topk_ids.shape[0] == x.shape[0]
          and (w13_scale is None) == (w2_scale is None))
    if int4 is not None:
        ok = ok and w13_scale is not None and all(
            z.shape == s.shape and s.shape[:2] == w.shape[:2] and s.is_contiguous()
            and z.is_contiguous() and s.shape[2] == -(-w.shape[2] * 2 // int4.group_size)
            for w, s, z in ((w13, w13_scale, int4.w13_zero), (w2, w2_scale, int4.w2_zero)))
    elif w13_scale is not None:
        ok = ok and (tuple(w13_scale.shape) == (num_experts, two_i)
                     and tuple(w2_scale.shape) == (num_experts, hidden))
    if not ok or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError(f"fused_moe: shapes do not match: x {tuple(x.shape)}, w13 "
                         f"{tuple(w13.shape)}, w2 {tuple(w2.shape)}, topk {tuple(topk_ids.shape)}")


@dataclass(frozen=True)
class _Weights:
    """One stacked expert weight with what its kernels need to read it."""

    w: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    int4: Int4Experts | None

    @property
    def in_features(self) -> int:
        return self.w.shape[2] * (2 if self.int4 is not None else 1)

    def kernel_args(self, like: torch.Tensor) -> tuple:
        """(scale, zero, scale expert stride, scale row stride); placeholders where absent."""
        scale = self.scale if self.scale is not None else like
        zero = self.zero if self.zero is not None else like
        strides = (self.scale.stride(0), self.scale.stride(1)) if self.scale is not None \
            else (0, 0)
        return scale, zero, *strides

    def flags(self) -> dict:
        int4 = self.int4 is not None
        return dict(HAS_SCALE=self.scale is not None and not int4, INT4=int4,
                    GROUP=self.int4.group_size if int4 else 1)


def _decode(x, w13: _Weights, w2: _Weights, topk_weights, topk_ids, cfg):
    num_tokens, top_k = topk_ids.shape
    inter, hidden = w2.in_features, w2.w.shape[1]
    pairs = num_tokens * top_k
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    up_cfg = cfg or gemv_config(pairs, inter, w13.w)
    s13, z13, s13_e, s13_n = w13.kernel_args(topk_weights)
    _moe_gate_up_gemv_kernel[(pairs, triton.cdiv(inter, up_cfg.block_n))](
        x, w13.w, s13, z13, topk_ids, act, inter, hidden, x.stride(0), w13.w.stride(0),
        w13.w.stride(1), act.stride(0), s13_e, s13_n, TOP_K=top_k, **w13.flags(),
        BLOCK_N=up_cfg.block_n, BLOCK_K=up_cfg.block_k, num_warps=up_cfg.num_warps)
    down_cfg = cfg or gemv_config(pairs, hidden, w2.w)
    tiles = triton.cdiv(hidden, down_cfg.block_n)
    part = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    cnt = counters(x.device, num_tokens * tiles)
    s2, z2, s2_e, s2_n = w2.kernel_args(topk_weights)
    _moe_down_gemv_kernel[(pairs, tiles)](
        act, w2.w, s2, z2, topk_ids, topk_weights, part, out, cnt, hidden, inter,
        act.stride(0), w2.w.stride(0), w2.w.stride(1), part.stride(0), out.stride(0), s2_e,
        s2_n, TOP_K=top_k, **w2.flags(), BLOCK_N=down_cfg.block_n,
        BLOCK_K=down_cfg.block_k, num_warps=down_cfg.num_warps)
    return out


def _grouped(x, w13: _Weights, w2: _Weights, topk_weights, topk_ids, cfg):
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden = w13.w.shape[0], w13.in_features
    inter = w2.in_features
    pairs = num_tokens * top_k
    cfg = cfg or gemm_config(pairs, num_experts)
    sorted_pairs, block_experts, num_padded = align_by_expert(topk_ids, num_experts, cfg.block_m)
    m_blocks = block_experts.numel()
    # float32 activations get float32 products (the CPU path's), not TF32.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    s13, z13, s13_e, s13_n = w13.kernel_args(topk_weights)
    _moe_gemm_kernel[(triton.cdiv(inter, cfg.block_n), m_blocks)](
        x, w13.w, act, s13, z13, topk_weights, sorted_pairs, block_experts, num_padded, inter,
        hidden, pairs, x.stride(0), w13.w.stride(0), w13.w.stride(1), act.stride(0), s13_e,
        s13_n, A_ROW_DIV=top_k, GATED=True, MUL_WEIGHT=False, **w13.flags(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    # Pairs routed to experts held elsewhere (-1) are in no block: their rows must read zero.
    down = torch.zeros(pairs, hidden, dtype=x.dtype, device=x.device)
    s2, z2, s2_e, s2_n = w2.kernel_args(topk_weights)
    _moe_gemm_kernel[(triton.cdiv(hidden, cfg.block_n), m_blocks)](
        act, w2.w, down, s2, z2, topk_weights, sorted_pairs, block_experts, num_padded, hidden,
        inter, pairs, act.stride(0), w2.w.stride(0), w2.w.stride(1), down.stride(0), s2_e, s2_n,
        A_ROW_DIV=1, GATED=False, MUL_WEIGHT=True, **w2.flags(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return down.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)
