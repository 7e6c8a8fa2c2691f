"""Triton GEMV / skinny GEMM for decode: out[M, N] = x[M, K] @ weight[N, K]^T (+ bias), M <= 16.

Memory-bound: the weight is streamed once with wide loads, a [BLOCK_N, BLOCK_K] tile per step.
Long K is split across programs (split-K) and reduced without a second launch: every program
stores its partial sums, and the last one to arrive on a per-tile counter adds them in a fixed
order (deterministic), applies the bias, writes the output and resets the counter to zero.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.kernels.gemv.weight_convert import weight_to_float
from slipstream.kernels.runtime import pdl
from slipstream.kernels.runtime.pdl import pdl_release, pdl_wait

MAX_M = 16


@triton.jit
def finish(part, ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k, offs_m, offs_n, M, N,
            stride_om, split_k, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Write part ([BLOCK_M, BLOCK_N] float32) to the output, reducing over the K splits."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    part, done = reduce_splits(part, ws_ptr + offs_m[:, None] * N + offs_n[None, :], mask,
                                M * N, cnt_ptr + pid_n, pid_k, split_k, SPLIT)
    if done:
        if HAS_BIAS:
            part += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 part.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def reduce_splits(part, ws_ptrs, mask, split_stride, cnt_ptr, pid_k, split_k,
                   SPLIT: tl.constexpr):
    """Split-K without a second launch: (the sum over every split of this tile's part, whether
    this program holds it). Each program stores its part at ws_ptrs + pid_k * split_stride;
    the last to arrive on the tile's counter adds all of them in a fixed order (the same sum on
    every run) and resets the counter to zero."""
    done = True
    if SPLIT:
        tl.store(ws_ptrs + pid_k * split_stride, part, mask=mask)
        # All threads' partial stores happen before the release of the arrival count.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        done = arrived == split_k - 1
        if done:
            part = tl.zeros_like(part)
            for i in range(0, split_k):
                part += tl.load(ws_ptrs + i * split_stride, mask=mask, other=0.0,
                                cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr, 0)
    return part, done


@triton.jit
def tile_rows(pid_n, N, BLOCK_N: tl.constexpr, GATE_OUT: tl.constexpr):
    """Weight rows of program pid_n's tile. Rows past N re-read row N-1 (no mask needed).
    GATE_OUT (a [gate | up] weight of N = 2I rows): the tile's first half is gate rows
    j0 .. j0 + BLOCK_N/2 - 1 and its second half the matching up rows I + j0 .., so that the
    program can write SiLU(gate)·up for its BLOCK_N/2 columns (finish_gate_out)."""
    r = tl.arange(0, BLOCK_N)
    if GATE_OUT:
        half = N // 2
        j = tl.minimum(pid_n * (BLOCK_N // 2) + r % (BLOCK_N // 2), half - 1)
        rows = tl.where(r < BLOCK_N // 2, j, half + j)
    else:
        rows = tl.minimum(pid_n * BLOCK_N + r, N - 1)
    return rows.to(tl.int64)


@triton.jit
def finish_gate_out(part, rows, ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k, N, split_k,
                     SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """M == 1, GATE_OUT: part [BLOCK_N] holds the tile's gate then up sums (tile_rows); write
    SiLU(gate)·up for its BLOCK_N/2 columns, each operand rounded to the output dtype first:
    the values silu_and_mul computes from the stored gate/up projection. Split-K partials are
    reduced as in finish (workspace: BLOCK_N floats per tile and split)."""
    HALF: tl.constexpr = BLOCK_N // 2
    v = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    part, done = reduce_splits(part, ws_ptr + v, v >= 0, tl.num_programs(0) * BLOCK_N,
                                cnt_ptr + pid_n, pid_k, split_k, SPLIT)
    if done:
        if HAS_BIAS:
            part += tl.load(bias_ptr + rows).to(tl.float32)
        out_ty = out_ptr.dtype.element_ty
        g, u = tl.split(tl.permute(tl.reshape(part, (2, HALF)), (1, 0)))
        g = g.to(out_ty).to(tl.float32)
        u = u.to(out_ty).to(tl.float32)
        j = pid_n * HALF + tl.arange(0, HALF)
        tl.store(out_ptr + j, (g * tl.sigmoid(g) * u).to(out_ty), mask=j < N // 2)


@triton.jit
def load_x(ptrs, mask, gate_off, GATED: tl.constexpr, EVEN_K: tl.constexpr,
            ANCHOR: tl.constexpr = False):
    """A tile of the GEMV input. GATED: the input is the gate/up projection's [gate | up]
    output (up at gate_off past gate) and the tile is silu(gate) * up, rounded to the input
    dtype as the separate silu_and_mul kernel would store it: the activation needs no launch.
    ANCHOR (16-bit x, GPU only): the activation is computed in the layout it is loaded in (an
    opaque identity marks the result): otherwise Triton computes it after the conversion to the
    product's operand layout, where every warp holds the whole tile (sm_90 SASS, M=2-16 dequant
    kernel: 2,581 -> 1,010 instructions per K step; bf16: 1,154 -> 359)."""
    if EVEN_K:
        g = tl.load(ptrs)
    else:
        g = tl.load(ptrs, mask=mask, other=0.0)
    if GATED:
        if EVEN_K:
            u = tl.load(ptrs + gate_off)
        else:
            u = tl.load(ptrs + gate_off, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        g = (gf * tl.sigmoid(gf) * u.to(tl.float32)).to(g.dtype)
        if ANCHOR and g.dtype.primitive_bitwidth == 16:
            g = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [g], dtype=g.dtype,
                                          is_pure=False, pack=2)
    return g


# M and the split count are runtime values (no recompile per batch size or shape).
@triton.jit(do_not_specialize=["M", "split_k"])
def gemv_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
                 stride_wn, stride_om, k_per_split, split_k, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, PREFETCH: tl.constexpr, GATED: tl.constexpr = False,
                 USE_PDL: tl.constexpr = False, STAGES: tl.constexpr = 1,
                 GATE_OUT: tl.constexpr = False, HAS_SCALE: tl.constexpr = False,
                 BIT_CONVERT: tl.constexpr = 0, WHOLE_K: tl.constexpr = False,
                 RMS_EPS: tl.constexpr = 0.0, RMS_KP: tl.constexpr = 0):
    """M == 1: elementwise products into a 2-D float32 accumulator, one reduction at the end.

    PREFETCH issues the next weight tile's loads before this tile's arithmetic: two tiles in
    flight per program, in registers (2 or 3: the tile that many ahead, three or four in
    flight). STAGES > 1 instead asks Triton to pipeline the loop (tl.range): tiles stream
    through shared memory by asynchronous copies, STAGES - 1 ahead, without the registers.
    Under PDL the first tile's loads are issued before waiting for the previous kernel
    (kernels/runtime/pdl.py). GATE_OUT: see tile_rows. HAS_SCALE (the dequant GEMV,
    kernels/gemv/int8.py): INT8 / FP8 weights converted per BIT_CONVERT
    (kernels/gemv/weight_convert.py), the sums scaled per output column (s_ptr). WHOLE_K (with
    PREFETCH, one tile spanning K, no split): the program's whole weight slice is requested
    before the wait, so a GEMV after a latency-bound kernel (attention) has its weights in
    registers when its input is ready; no loop, no tile requested ahead. RMS_EPS > 0 (not
    GATED): x is the residual stream h and the product is taken with h / rms(h), the
    RMSNorm whose weight was folded into this weight at load (models/norm_fold.py): the sum of
    squares of the x tiles it loads anyway, 1 / rms applied to the row sums at the end. With a K
    split (RMS_KP: K rounded up to a power of two) each program reads all of x for the statistic
    (8 KB at K = 4096, from L2), requested right after the PDL wait and reduced after its loop;
    1 / rms is a common factor of the splits' partial sums, so their reduction is unchanged.
    """
    pdl_release(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tile_rows(pid_n, N, BLOCK_N, GATE_OUT)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    if WHOLE_K:
        w = _load_w_tile(w_ptrs, 0, 0, K, offs_k, EVEN_K, BLOCK_K)
        pdl_wait(USE_PDL)
        x = load_x(x_ptr + offs_k, offs_k < K, K, GATED, EVEN_K)
        if RMS_EPS > 0:  # reduced before the products: x's float32 copy is not kept alive
            square_sum = tl.sum(x.to(tl.float32) * x.to(tl.float32))
        acc = _tile_product(w, x, BIT_CONVERT)
    else:
        acc, square_sum = _k_loop(w_ptrs, x_ptr, offs_k, k_lo, k_hi, K, BLOCK_N, BLOCK_K,
                                  PREFETCH, STAGES, GATED, EVEN_K, BIT_CONVERT, USE_PDL,
                                  RMS_EPS > 0, RMS_KP)
    sums = tl.sum(acc, 1)
    if RMS_EPS > 0:  # the same float32 statistic as the RMSNorm kernel: mean of squares + eps
        sums = sums * tl.math.rsqrt(square_sum / K + RMS_EPS)
    if HAS_SCALE:
        scale = tl.load(s_ptr + rows)
        if BIT_CONVERT == 2:
            scale = scale * 1048576.0  # 2^20: with x's 2^100, undoes the 2^-120
        sums = sums * scale
    if GATE_OUT:
        finish_gate_out(sums, rows, ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k, N, split_k,
                         SPLIT, HAS_BIAS, BLOCK_N)
    else:
        finish(sums[None, :], ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k, tl.arange(0, 1),
                offs_n, M, N, stride_om, split_k, SPLIT, HAS_BIAS)


@triton.jit
def _k_loop(w_ptrs, x_ptr, offs_k, k_lo, k_hi, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            PREFETCH: tl.constexpr, STAGES: tl.constexpr, GATED: tl.constexpr,
            EVEN_K: tl.constexpr, BIT_CONVERT: tl.constexpr, USE_PDL: tl.constexpr,
            SQUARES: tl.constexpr, FULL_KP: tl.constexpr = 0):
    """gemv_kernel's loop over the program's K range (see its PREFETCH / STAGES): the float32
    products [BLOCK_N, BLOCK_K] and (SQUARES) the sum of x's squares, over the range or
    (FULL_KP > 0: K rounded up to a power of two) over all of x, read after the PDL wait and
    reduced after the loop. The PDL wait comes after the first prefetched tiles are requested."""
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    squares = tl.zeros([BLOCK_K], tl.float32)
    if PREFETCH:  # PREFETCH tiles (1-3) requested ahead, the first ones before the PDL wait
        n1 = _load_w_tile(w_ptrs, k_lo, k_lo, k_hi, offs_k, EVEN_K, BLOCK_K)
        n2, n3 = n1, n1
        if PREFETCH >= 2:
            n2 = _load_w_tile(w_ptrs, k_lo + BLOCK_K, k_lo, k_hi, offs_k, EVEN_K, BLOCK_K)
        if PREFETCH >= 3:
            n3 = _load_w_tile(w_ptrs, k_lo + 2 * BLOCK_K, k_lo, k_hi, offs_k, EVEN_K, BLOCK_K)
    pdl_wait(USE_PDL)
    if FULL_KP:
        offs_all = tl.arange(0, FULL_KP)
        x_all = tl.load(x_ptr + offs_all, mask=offs_all < K, other=0.0)
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        if PREFETCH:
            w = n1
            ahead = _load_w_tile(w_ptrs, k + PREFETCH * BLOCK_K, k_lo, k_hi, offs_k, EVEN_K,
                                 BLOCK_K)
            if PREFETCH == 3:
                n1, n2, n3 = n2, n3, ahead
            elif PREFETCH == 2:
                n1, n2 = n2, ahead
            else:
                n1 = ahead
        else:
            w = _load_w_tile(w_ptrs, k, k_lo, k_hi, offs_k, EVEN_K, BLOCK_K)
        x = load_x(x_ptr + k + offs_k, k + offs_k < k_hi, K, GATED, EVEN_K)
        acc += _tile_product(w, x, BIT_CONVERT)
        if SQUARES and not FULL_KP:
            squares += x.to(tl.float32) * x.to(tl.float32)
    if FULL_KP:
        return acc, tl.sum(x_all.to(tl.float32) * x_all.to(tl.float32))
    return acc, tl.sum(squares)


@triton.jit
def _tile_product(w, x, BIT_CONVERT: tl.constexpr):
    """Elementwise products of a weight tile [BLOCK_N, BLOCK_K] and an x slice [BLOCK_K], float32."""
    xf = x.to(tl.float32)
    if BIT_CONVERT == 2:
        xf = xf * 1.2676506002282294e30  # 2^100: products of 2^-120-scaled weights stay normal
    return weight_to_float(w, BIT_CONVERT) * xf[None, :]


@triton.jit
def _load_w_tile(w_ptrs, k, k_lo, k_hi, offs_k, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight tile at column k of this program's K range."""
    if EVEN_K:
        # Past the end (the prefetch after the last tile) re-read the last tile: no mask needed.
        return tl.load(w_ptrs + tl.minimum(k, k_hi - BLOCK_K))
    else:
        return tl.load(w_ptrs + k, mask=(k + offs_k < k_hi)[None, :], other=0.0)


@triton.jit(do_not_specialize=["M", "split_k"])
def skinny_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
                   stride_wn, stride_om, k_per_split, split_k, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                   EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
                   GATED: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                   ANCHOR_GATED: tl.constexpr = False, HAS_SCALE: tl.constexpr = False):
    """1 < M <= 16: a [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tensor-core product per step.
    HAS_SCALE (the dequant GEMV, kernels/gemv/int8.py): INT8 / FP8 weights, exact in x's dtype,
    converted per tile; the products scaled per output column (s_ptr) at the end."""
    pdl_release(USE_PDL)
    pdl_wait(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_rows = tl.minimum(offs_m, M - 1)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    # The weight tile is read as [BLOCK_K, BLOCK_N] (K contiguous) to feed the product directly.
    w_ptrs = w_ptr + rows[None, :] * stride_wn + offs_k[:, None]
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        k_ok = k + offs_k < k_hi
        if EVEN_K:
            w = tl.load(w_ptrs + k)
        else:
            w = tl.load(w_ptrs + k, mask=k_ok[:, None], other=0.0)
        x = load_x(x_ptrs + k, k_ok[None, :], K, GATED, EVEN_K, ANCHOR_GATED)
        if HAS_SCALE:
            w = w.to(x.dtype)
        acc = tl.dot(x, w, acc, input_precision=DOT_PREC)
    if HAS_SCALE:
        acc = acc * tl.load(s_ptr + rows)[None, :]
    finish(acc, ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k, offs_m, offs_n, M, N,
            stride_om, split_k, SPLIT, HAS_BIAS)


@dataclass(frozen=True)
class GemvConfig:
    """Tile shape, split-K factor (0: pick from the shape) and launch parameters."""

    block_n: int
    block_k: int
    split_k: int = 0
    num_warps: int = 4
    num_stages: int = 1  # M == 1 without prefetch: > 1 pipelines tiles through shared memory
    # M == 1 kernel only: keep two weight tiles in flight (2 or 3: that many tiles requested
    # ahead; the int4 few-row kernels take it too).
    prefetch: bool | int = False
    # Dequant-GEMV (kernels/gemv/int8.py) at M == 1 only: convert int8 / fp8 weights by bit
    # tricks instead of conversion instructions (1; 2: int8 by byte permutes in inline PTX);
    # or run the tensor-core (tl.dot) kernel.
    bit_convert: int = 0
    dot: bool = False
    # FP8 weights only (kernels/gemv/fp8.py): activations quantized to FP8 in the kernel and
    # FP8 tensor-core products, any M <= 16.
    fp8_act: bool = False
    # int4 weights converted straight into mma.sync fragments, 1-16 rows of bf16 x
    # (kernels/gemv/int4_mma.py); block_n 16 or 32 rows per warp.
    mma: bool = False
    # One-row int4 whole-K tiles only: at most this many programs an SM, each looping over tiles
    # with the next tile's weights in flight (gemv_int4's whole-K loop); 0: a program a tile.
    persist: int = 0


COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}
_NUM_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Multiprocessors of the device (4 off CUDA, so the interpreter exercises split paths)."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def counters(device: torch.device, n: int) -> torch.Tensor:
    """Arrival counters shared by every call on a device; each call leaves them at zero.

    Shared, so two split-K calls must not run concurrently on different streams.
    """
    key = (device.type, device.index)
    buf = COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        COUNTERS[key] = buf
    return buf


def default_config(m: int, n: int, k: int) -> GemvConfig:
    """A reasonable config without measuring (used when tuning is not possible)."""
    if m == 1:
        return GemvConfig(block_n=8, block_k=512, num_warps=4, prefetch=True)
    return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)


def candidate_configs(m: int, n: int, k: int) -> list[GemvConfig]:
    """The configs a per-shape tuner measures (see triton_ops.linear): few, since each one is a
    compile at start-up (shared across shapes: split count and M are runtime values)."""
    if m == 1:  # (block_n, block_k, split_k, num_warps, prefetch); split_k 0: from the shape
        tiles = [(8, 512, 0, 4, True), (16, 512, 0, 4, False), (8, 1024, 0, 4, False),
                 (32, 256, 0, 4, True), (16, 1024, 0, 8, False), (4, 1024, 0, 2, False),
                 (16, 512, 1, 4, True),
                 # Narrow tiles without split: more programs in flight for N of 4-6k (o, qkv).
                 (4, 512, 1, 2, True), (4, 256, 1, 2, True), (8, 256, 1, 4, True)]
        # Tiles streamed through shared memory (tl.range stages) instead of registers.
        staged = [GemvConfig(bn, bk, 0, w, st) for bn, bk, w, st in
                  [(8, 512, 4, 4), (4, 1024, 2, 4), (16, 256, 4, 4)]]
        return [GemvConfig(bn, bk, sk, w, 1, pf) for bn, bk, sk, w, pf in tiles] + staged
    tiles = [(64, 128, 0, 4, 4), (32, 128, 0, 4, 4), (64, 256, 0, 4, 3), (64, 128, 1, 4, 4)]
    return [GemvConfig(bn, bk, sk, w, st) for bn, bk, sk, w, st in tiles]


def choose_split_k(cfg: GemvConfig, n: int, k: int, device: torch.device) -> tuple[int, int]:
    """(split_k, k_per_split): enough programs for ~4 resident per SM, K chunks a BLOCK_K multiple."""
    k_tiles = triton.cdiv(k, cfg.block_k)
    split = cfg.split_k
    if split <= 0:
        n_tiles = triton.cdiv(n, cfg.block_n)
        split = min(triton.cdiv(4 * num_sms(device), n_tiles), k_tiles, 16)
    split = max(1, min(split, k_tiles))
    per_split = triton.cdiv(k_tiles, split) * cfg.block_k
    return triton.cdiv(k, per_split), per_split


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, gated: bool = False,
         gate_out: bool = False, rms_eps: float = 0.0) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T (+ bias) for at most MAX_M rows of x; output in x's dtype.

    gated: x is [..., 2K] = [gate | up] and the product is silu(gate) * up @ weight^T.
    gate_out (one row, a [gate | up] weight, config gate_out_ok): the output is
    silu_and_mul of the product, [..., N / 2], in the same launch.
    rms_eps > 0 (one row, config rms_ok): the product is taken with x / rms(x) (an RMSNorm with
    this eps whose weight was folded into `weight`), bias added after.
    """
    if gate_out:
        return gemv_gate_out(x, weight, bias, config or default_config(1, *weight.shape),
                              rms_eps=rms_eps)
    x2, weight, m, n, k = gemv_operands(x, weight, gated)
    if rms_eps and (m != 1 or gated):
        raise ValueError(f"rms_eps needs one row of a plain input; got M={m}, gated={gated}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    cfg = config or default_config(m, n, k)
    split, per_split, n_tiles, ws, cnt = split_buffers(cfg, m, n, k, out)
    b = bias if bias is not None else out
    common = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1,
                  EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None, GATED=gated,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    # The weight stands in for the unread scale (HAS_SCALE off).
    args = (x2, weight, weight, b, out, ws, cnt, m, n, k, x2.stride(0), weight.stride(0),
            out.stride(0), per_split, split)
    if m == 1:
        gemv_kernel[(n_tiles, split)](*args, **one_row_path(cfg, k, split, rms_eps), **common,
                                       **pdl.launch_kwargs(x.device))
    else:
        prec = "ieee" if x.dtype == torch.float32 else "tf32"
        skinny_kernel[(n_tiles, split)](*args, BLOCK_M=16, DOT_PREC=prec, **common,
                                         ANCHOR_GATED=gated and x.is_cuda,
                                         **pdl.launch_kwargs(x.device))
    return out.view(*x.shape[:-1], n)


def whole_k(cfg: GemvConfig, k: int, split: int) -> bool:
    """Whether the one-row kernel takes its WHOLE_K path: a register-prefetching tile that spans
    K in a single program (the weight slice requested before the PDL wait)."""
    return bool(cfg.prefetch) and split == 1 and cfg.block_k >= k


def one_row_path(cfg: GemvConfig, k: int, split: int, rms_eps: float = 0.0) -> dict:
    """gemv_kernel's loop constexprs for a config. Every launch of a config (the plain product
    the tuner times, and gate_out, which reuses the plain product's choice) takes them from here,
    so they run the code that was timed: a whole-K tile sent down the loop path instead keeps a
    [BLOCK_N, K] float32 accumulator and two weight tiles live (register spills, many times
    slower). rms_eps: see gemv; with a K split every program
    reads all of x for the statistic (RMS_KP), which must fit beside the loop (rms_ok)."""
    if rms_eps and split > 1 and not split_rms_fits(cfg, k):
        raise ValueError(f"rms_eps with a K split holds all of x in every program: K={k} is too "
                         f"long for {cfg.num_warps} warps; use a config without a split")
    return dict(PREFETCH=cfg.prefetch, STAGES=cfg.num_stages, WHOLE_K=whole_k(cfg, k, split),
                RMS_EPS=float(rms_eps),
                RMS_KP=triton.next_power_of_2(k) if rms_eps and split > 1 else 0)


# With a K split, a program holds all of x for the statistic until its loop ends: at most this
# many elements a thread (64 bf16: 32 registers; K = 4,096 with two warps), which ptxas fits
# without spills.
_RMS_X_PER_THREAD = 64


def rms_ok(m: int, n: int, k: int, cfg: GemvConfig | None, device: torch.device) -> bool:
    """Whether a one-row launch of cfg over an [n, k] weight can normalise x itself (rms_eps):
    the M == 1 kernel, and with a K split (gate_out launches split as the plain product does)
    an x that fits in registers beside the loop."""
    if m != 1 or cfg is None or cfg.dot or cfg.fp8_act or getattr(cfg, "mma", False):
        return False
    return choose_split_k(cfg, n, k, device)[0] == 1 or split_rms_fits(cfg, k)


def split_rms_fits(cfg: GemvConfig, k: int) -> bool:
    """Whether every program of a K-split launch can hold all of x for rms_eps's statistic."""
    return triton.next_power_of_2(k) <= _RMS_X_PER_THREAD * 32 * cfg.num_warps


def split_buffers(cfg: GemvConfig, m: int, n: int, k: int, out: torch.Tensor):
    """(split, k_per_split, n_tiles, workspace, counters) of a launch over [m, n] outputs;
    without a split the output stands in for the unused workspace and counters."""
    split, per_split = choose_split_k(cfg, n, k, out.device)
    n_tiles = triton.cdiv(n, cfg.block_n)
    if split == 1:
        return split, per_split, n_tiles, out, out
    ws = torch.empty((split, m, n), dtype=torch.float32, device=out.device)
    return split, per_split, n_tiles, ws, counters(out.device, n_tiles)


def call_kind(gate_out: bool, rms_eps: float) -> str:
    """A one-row call's kind in tuner keys and logs: '' (the plain product), 'gate-out', 'rms'
    (the in-GEMV norm) or 'gate-out rms'."""
    return " ".join(name for name, on in (("gate-out", gate_out), ("rms", rms_eps)) if on)


def gate_out_ok(m: int, n: int, cfg: GemvConfig | None) -> bool:
    """Whether the M == 1 kernels can write SiLU(gate)·up for this call (gate_out)."""
    return (m == 1 and n % 2 == 0 and cfg is not None and not cfg.dot and not cfg.fp8_act
            and cfg.block_n >= 2)


def gemv_gate_out(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   cfg: GemvConfig, scale: torch.Tensor | None = None,
                   bit_convert: int = 0, rms_eps: float = 0.0) -> torch.Tensor:
    """gemv(gate_out=True); with scale, the dequant GEMV's (kernels/gemv/int8.py)."""
    x2, weight, m, n, k = gemv_operands(x, weight, False)
    if not gate_out_ok(m, n, cfg):
        raise ValueError(f"gate_out needs one row, an even N and a one-row config; got M={m}, "
                         f"N={n}, {cfg}")
    out = torch.empty((1, n // 2), dtype=x.dtype, device=x.device)
    split, per_split, n_tiles, ws, cnt = gate_out_launch(cfg, n, k, x.device)
    gemv_kernel[(n_tiles, split)](
        x2, weight, weight if scale is None else scale, bias if bias is not None else out, out,
        ws, cnt, 1, n, k, x2.stride(0), weight.stride(0), out.stride(0), per_split, split,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1, EVEN_K=k % cfg.block_k == 0,
        HAS_BIAS=bias is not None, **one_row_path(cfg, k, split, rms_eps), GATE_OUT=True,
        HAS_SCALE=scale is not None, BIT_CONVERT=bit_convert, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl.launch_kwargs(x.device))
    return out.view(*x.shape[:-1], n // 2)


def gate_out_launch(cfg: GemvConfig, n: int, k: int, device: torch.device):
    """(split, k_per_split, tiles, workspace, counters) of a gate_out launch: tiles of
    block_n / 2 output columns, split-K chosen as for the plain product of that many tiles."""
    n_tiles = triton.cdiv(n // 2, cfg.block_n // 2)
    split, per_split = choose_split_k(cfg, n, k, device)
    ws = torch.empty((split, n_tiles * cfg.block_n), dtype=torch.float32, device=device)
    cnt = counters(device, n_tiles) if split > 1 else ws
    return split, per_split, n_tiles, ws, cnt


def gemv_operands(x: torch.Tensor, weight: torch.Tensor, gated: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """(x as [M, K or 2K] and the weight, both with unit column stride, M, N, K), checking the
    shapes."""
    k = weight.shape[1]
    if x.shape[-1] != (2 * k if gated else k):
        raise ValueError(f"gemv: x has {x.shape[-1]} columns, weight has K={k}"
                         f"{' (gated input needs 2K)' if gated else ''}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] > MAX_M:
        raise ValueError(f"gemv handles at most {MAX_M} rows, got {x2.shape[0]}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    return x2, weight, x2.shape[0], weight.shape[0], k
