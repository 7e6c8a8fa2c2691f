"""W8A8 FP8 decode GEMV on the tensor cores, M <= 16: each program quantizes x per token to FP8
(as quantization.utils.quantize_per_token does) and runs FP8 x FP8 tl.dot into float32, so no
weight is ever converted. Split-K and its in-kernel reduction are those of kernels/gemv.py.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from slipstream.kernels import pdl
from slipstream.kernels.gemv import (
    MAX_M,
    GemvConfig,
    _counters,
    _finish,
    _gemv_operands,
    _load_x,
    _split_k,
)
from slipstream.kernels.pdl import pdl_release, pdl_wait
from slipstream.kernels.tuning import graph_time_us, weight_copies
from slipstream.quantization.utils import _TINY, FP8_DTYPE, FP8_MAX

logger = logging.getLogger(__name__)
# x elements per step of the scale pass: wide, so few dependent L2 round trips (one or two
# at M=1) hold back the weight stream, which starts after it.
_PRE_ELEMS = 4096


@triton.jit
def _round_e4m3(y):
    """y (float32, |y| <= 448) rounded to the nearest E4M3 value, ties to even, in float32 math.
    The interpreter's float32 -> fp8 cast truncates; the GPU's cvt.rn needs none of this."""
    bits = y.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000  # keep 3 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    mag = tl.abs(y)
    sub = (mag + 16384.0) - 16384.0  # below 2^-6: multiples of 2^-9 (2^14's float32 ulp)
    sub = tl.where(y < 0, -sub, sub)
    return tl.where(mag < 0.015625, sub, normal)


@triton.jit
def _pad_rows(t, ROWS: tl.constexpr):
    """[ROWS, C] -> [16, C] with row i = row i % ROWS: the dot's 16 rows from the ROWS computed
    (rows at or past M are never stored, so their contents do not matter)."""
    if ROWS == 16:
        out = t
    elif ROWS == 1:
        out = tl.broadcast_to(t, (16, t.shape[1]))
    else:
        out = tl.reshape(tl.broadcast_to(t[None, :, :], (16 // ROWS, ROWS, t.shape[1])),
                         (16, t.shape[1]))
    return out


@triton.jit
def _row_scales(x_ptr, x_rows, stride_xm, K, QMAX: tl.constexpr, TINY: tl.constexpr,
                PRE_K: tl.constexpr, PRE_EVEN: tl.constexpr, GATED: tl.constexpr):
    """[ROWS, 1] float32: max(amax(row over the full K) / QMAX, TINY), the per-token scale.
    Every program computes it again (x is small and L2-resident): no second launch."""
    offs = tl.arange(0, PRE_K)
    ptrs = x_ptr + x_rows[:, None] * stride_xm + offs[None, :]
    amax = tl.zeros([x_rows.shape[0], PRE_K], tl.float32)
    for k0 in range(0, K, PRE_K):
        x = _load_x(ptrs + k0, (k0 + offs < K)[None, :], K, GATED, PRE_EVEN)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    # Correctly rounded division, as torch divides (Triton's `/` is div.full, 2 ulp).
    return tl.maximum(tl.math.div_rn(tl.max(amax, 1), QMAX), TINY)[:, None]


@triton.jit
def _quantize(x, scale, rcp, QMAX: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """fp8(clamp(x / scale)) with the correctly rounded quotient: q0 = x * rcp is within an ulp,
    and one fma-corrected step (Markstein) rounds it exactly, for ~3 instructions."""
    q = x * rcp
    q = tl.fma(tl.fma(-q, scale, x), rcp, q)
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    if not NATIVE_FP8:
        q = _round_e4m3(q)  # exact E4M3 value: the interpreter's cast then loses nothing
    return q.to(tl.float8e4nv)


@triton.jit
def _load_w(w_ptrs, k, k_hi, offs_k, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] FP8 weight tile at column k (K contiguous: the K-major operand)."""
    if EVEN_K:
        w = tl.load(w_ptrs + k)
    else:
        w = tl.load(w_ptrs + k, mask=(k + offs_k < k_hi)[None, :], other=0.0)
    return w


@triton.jit
def _tile_dot(acc, w, x_ptrs, k, k_hi, offs_k, scale, rcp, K, QMAX: tl.constexpr,
              ROWS: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr,
              W_IS_A: tl.constexpr, NATIVE_FP8: tl.constexpr, IMPRECISE: tl.constexpr):
    """acc += this K tile's FP8 x FP8 product. W_IS_A: w [BLOCK_N, BLOCK_K] is the A operand and
    acc is [BLOCK_N, 16] (M = BLOCK_N: Hopper's wgmma, which needs M % 64 == 0); else x is A
    and acc is [16, BLOCK_N] (mma.sync, which Triton runs through fp16 on sm_90)."""
    x = _load_x(x_ptrs + k, (k + offs_k < k_hi)[None, :], K, GATED, EVEN_K)
    xq = _pad_rows(_quantize(x.to(tl.float32), scale, rcp, QMAX, NATIVE_FP8), ROWS)
    # IMPRECISE: wgmma's FP8 accumulation is narrower than float32; every IMPRECISE k it is
    # added into the float32 accumulator.
    if W_IS_A:
        acc = tl.dot(w, tl.trans(xq), acc, max_num_imprecise_acc=IMPRECISE)
    else:
        acc = tl.dot(xq, tl.trans(w), acc, max_num_imprecise_acc=IMPRECISE)
    return acc


# M and the split count are runtime values; ROWS (next power of two of M) is not.
@triton.jit(do_not_specialize=["M", "split_k"])
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
                     stride_wn, stride_om, k_per_split, split_k, ROWS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE_K: tl.constexpr,
                     SPLIT: tl.constexpr, EVEN_K: tl.constexpr, PRE_EVEN: tl.constexpr,
                     HAS_BIAS: tl.constexpr, W_IS_A: tl.constexpr, NATIVE_FP8: tl.constexpr,
                     IMPRECISE: tl.constexpr, QMAX: tl.constexpr, TINY: tl.constexpr,
                     GATED: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    """out[m, n] = (sum_k xq[m, k] * wq[n, k]) * x_scale[m] * w_scale[n] (+ bias[n]) for this
    program's BLOCK_N outputs and K range; the dot's 16 rows are the ROWS computed, repeated."""
    pdl_release(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N re-read row N-1: no mask
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    # The first weight tile (no kernel writes weights) is in flight across the wait and the
    # scale pass; the loop below pipelines the rest (num_stages). (Multiplying it last instead,
    # to start the pipeline before it arrives, kept it in shared memory throughout: +1 tile.)
    w = _load_w(w_ptrs, k_lo, k_hi, offs_k, EVEN_K)
    pdl_wait(USE_PDL)
    x_rows = tl.minimum(tl.arange(0, ROWS), M - 1)
    scale = _row_scales(x_ptr, x_rows, stride_xm, K, QMAX, TINY, PRE_K, PRE_EVEN, GATED)
    rcp = tl.math.div_rn(tl.full([ROWS, 1], 1.0, tl.float32), scale)
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :]
    if W_IS_A:
        acc = tl.zeros([BLOCK_N, 16], tl.float32)
    else:
        acc = tl.zeros([16, BLOCK_N], tl.float32)
    acc = _tile_dot(acc, w, x_ptrs, k_lo, k_hi, offs_k, scale, rcp, K, QMAX, ROWS, EVEN_K, GATED,
                    W_IS_A, NATIVE_FP8, IMPRECISE)
    for k in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        w = _load_w(w_ptrs, k, k_hi, offs_k, EVEN_K)
        acc = _tile_dot(acc, w, x_ptrs, k, k_hi, offs_k, scale, rcp, K, QMAX, ROWS, EVEN_K,
                        GATED, W_IS_A, NATIVE_FP8, IMPRECISE)
    if W_IS_A:
        acc = tl.trans(acc)
    part = acc * _pad_rows(scale, ROWS) * tl.load(s_ptr + rows)[None, :]
    _finish(part, ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k, tl.arange(0, 16), offs_n,
            M, N, stride_om, split_k, SPLIT, HAS_BIAS)


@dataclass(frozen=True)
class Fp8GemvConfig(GemvConfig):
    """GemvConfig plus the operand order: weight_a puts the weight tile in the product's A slot
    ([BLOCK_N, 16] result, BLOCK_N a multiple of 64 on the GPU), the wgmma FP8 path on Hopper."""

    weight_a: bool = True


def default_fp8_config(m: int) -> Fp8GemvConfig:
    """The config used without measuring (off CUDA, or during a capture before tuning)."""
    return Fp8GemvConfig(block_n=64, block_k=256, num_warps=4, num_stages=4)


def candidate_fp8_configs(m: int) -> list[Fp8GemvConfig]:
    """The few configs fp8_linear_small measures per shape (each one a compile at start-up).
    split_k 0: from the shape (~4 programs per SM); 1: none, so fewer programs repeat the
    full-row scale pass (M * split_k / BLOCK_N extra x elements per weight byte)."""
    tiles = [(64, 256, 0, 4, 4), (64, 128, 0, 4, 6), (128, 128, 0, 4, 4), (128, 256, 0, 4, 3),
             (64, 512, 0, 4, 3), (128, 256, 0, 8, 4), (256, 128, 0, 8, 3), (64, 256, 1, 4, 4),
             (128, 256, 1, 4, 4)]
    cfgs = [Fp8GemvConfig(bn, bk, sk, w, st) for bn, bk, sk, w, st in tiles]
    # x as the A operand: 16-row mma.sync (Triton upcasts FP8 to fp16 for it on sm_90).
    return cfgs + [Fp8GemvConfig(64, 256, 0, 4, 4, weight_a=False)]


def fp8_gemv(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
             bias: torch.Tensor | None = None, config: GemvConfig | None = None,
             gated: bool = False) -> torch.Tensor:
    """W8A8 product for at most MAX_M rows of x: x [..., K] quantized per token to FP8 in the
    kernel, qweight FP8 E4M3 [N, K], w_scale float32 [N]; output in x's dtype.

    gated: x is [..., 2K] = [gate | up] and the input is silu(gate) * up in x's dtype.
    """
    if qweight.dtype != FP8_DTYPE:
        raise TypeError(f"fp8_gemv: weight dtype {qweight.dtype} is not {FP8_DTYPE}")
    x2, m, n, k = _gemv_operands(x, qweight, gated)
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    w_scale = w_scale.float().contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    cfg = config or default_fp8_config(m)
    split, per_split = _split_k(cfg, n, k, x.device)
    n_tiles = triton.cdiv(n, cfg.block_n)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = _counters(x.device, n_tiles) if split > 1 else out
    rows = triton.next_power_of_2(m)
    pre_k = max(16, min(_PRE_ELEMS // rows, triton.next_power_of_2(k)))
    _fp8_gemv_kernel[(n_tiles, split)](
        x2, qweight, w_scale, bias if bias is not None else out, out, ws, cnt, m, n, k,
        x2.stride(0), qweight.stride(0), out.stride(0), per_split, split, ROWS=rows,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRE_K=pre_k, SPLIT=split > 1,
        EVEN_K=k % cfg.block_k == 0, PRE_EVEN=k % pre_k == 0, HAS_BIAS=bias is not None,
        W_IS_A=getattr(cfg, "weight_a", True), NATIVE_FP8=x.is_cuda,
        IMPRECISE=min(cfg.block_k, 128), QMAX=FP8_MAX, TINY=_TINY, GATED=gated,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_kwargs(x.device))
    return out.view(*x.shape[:-1], n)


@dataclass(frozen=True)
class _Choice:
    """A measured choice. separate_act (gated input only): run the silu_and_mul kernel first and
    the plain product after it; every program of the gated kernel repeats silu over the full row
    for the scale, which at larger M can cost more than the extra launch."""

    config: GemvConfig
    separate_act: bool = False


_CHOICES: dict[tuple, _Choice | None] = {}


def fp8_linear_small(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """fp8_gemv with a config measured once per (M bucket, N, K, dtype, gated) on CUDA.
    If no candidate compiles and matches the reference, or the dequant-GEMV (gemv_int8, bf16
    activations) measured faster, that runs instead."""
    k = qweight.shape[1]
    m = x.numel() // x.shape[-1]
    bucket = 1 if m == 1 else 4 if m <= 4 else MAX_M
    key = (bucket, qweight.shape[0], k, x.dtype, gated, x.device.index)
    if key not in _CHOICES:
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return fp8_gemv(x, qweight, w_scale, bias, gated=gated)
        _CHOICES[key] = _measure(bucket, qweight, w_scale, bias, x.dtype, gated)
    choice = _CHOICES[key]
    if choice is None:
        from slipstream.kernels.gemv_int8 import qlinear_small

        return qlinear_small(x, qweight, w_scale, bias, gated=gated)
    if choice.separate_act:
        from slipstream.kernels.activation import silu_and_mul

        x, gated = silu_and_mul(x), False
    return fp8_gemv(x, qweight, w_scale, bias, choice.config, gated=gated)


def _measure(m: int, qweight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
             dtype: torch.dtype, gated: bool) -> _Choice | None:
    """The fastest candidate in a CUDA graph (kernels/tuning.py) among those that match the
    reference; None (run the dequant-GEMV) when none does or the dequant-GEMV is faster."""
    k = qweight.shape[1]
    x = torch.randn((m, 2 * k if gated else k), device=qweight.device, dtype=dtype)
    expect = fp8_gemv_reference(x, qweight, w_scale, bias, gated).float()
    tol = 2e-2 * expect.abs().max().item()
    tensors = (x, qweight, w_scale) if bias is None else (x, qweight, w_scale, bias)
    arg_sets = weight_copies(tensors)
    best, best_us = None, float("inf")
    for choice in _choices(m, gated):
        run = _runner(choice, gated)
        try:
            if not torch.allclose(run(tensors).float(), expect, rtol=2e-2, atol=tol):
                continue  # a miscompiled config must never be chosen
            us = graph_time_us(run, arg_sets)
        except Exception:  # e.g. out of shared memory for this tile
            continue
        if us < best_us:
            best, best_us = choice, us
    if best is None:
        logger.warning("fp8_gemv: no candidate config works for M=%d N=%d K=%d%s; using the "
                       "dequant-GEMV", m, qweight.shape[0], k, " (gated)" if gated else "")
        return None
    # The dequant-GEMV (bf16 activations) competes too: where it streams faster, it runs.
    dequant_us = _dequant_gemv_us(arg_sets, gated)
    logger.info("fp8 linear M<=%d N=%d K=%d%s: %s (%.1f us; dequant-GEMV %.1f us)", m,
                qweight.shape[0], k, " gated" if gated else "", best, best_us, dequant_us)
    return best if best_us <= dequant_us else None


def _dequant_gemv_us(arg_sets: list[tuple[torch.Tensor, ...]], gated: bool) -> float:
    """Graph-timed microseconds of gemv_int8.qlinear_small (tuned on its first call) on arg_sets."""
    from slipstream.kernels.gemv_int8 import qlinear_small

    def run(a: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return qlinear_small(a[0], a[1], a[2], a[3] if len(a) > 3 else None, gated=gated)

    try:
        run(arg_sets[0])  # its own tuning, outside the timed graph
        return graph_time_us(run, arg_sets)
    except Exception:  # no usable dequant-GEMV: the FP8 kernel stays
        return float("inf")


def _choices(m: int, gated: bool) -> list[_Choice]:
    cfgs = candidate_fp8_configs(m)
    return [_Choice(c) for c in cfgs] + ([_Choice(c, True) for c in cfgs] if gated else [])


def _runner(choice: _Choice, gated: bool):
    """args (x, qweight, w_scale[, bias]) -> the product as this choice computes it."""
    if choice.separate_act:
        from slipstream.kernels.activation import silu_and_mul

        return lambda a: fp8_gemv(silu_and_mul(a[0]), *a[1:], config=choice.config)
    return lambda a: fp8_gemv(*a, config=choice.config, gated=gated)


def fp8_gemv_reference(x: torch.Tensor, qweight: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """The plain-torch twin: per-token FP8 quantization, float32 sum of the exact FP8 products,
    then both scales (the kernel's order of operations)."""
    from slipstream.kernels.reference import silu_and_mul
    from slipstream.quantization.utils import quantize_per_token

    x2 = x.reshape(-1, x.shape[-1])
    if gated:
        x2 = silu_and_mul(x2)
    xq, x_scale = quantize_per_token(x2, FP8_DTYPE)
    out = (xq.float() @ qweight.float().t()) * x_scale * w_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])
