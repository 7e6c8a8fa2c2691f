"""Triton dequant-GEMV for decode: out = x @ (q * scale[:, None])^T (+ bias), M <= 16.

The weight q [N, K] is INT8 (or FP8 E4M3) with one float32 scale per output channel. It is read
once, converted in registers, and the scale is applied to each program's partial sum (the scale
does not depend on k). Split-K and its in-kernel reduction are those of kernels/gemv.py.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from slipstream.kernels import gemv as _gemv
from slipstream.kernels import pdl
from slipstream.kernels.gemv import (
    MAX_M,
    GemvConfig,
    _finish,
    _finish_gate_out,
    _gemv_operands,
    _load_w_tile,
    _load_x,
    _tile_rows,
    gate_out_launch,
    gate_out_ok,
    split_buffers,
)
from slipstream.kernels.gemv_fp8 import fp8_dot_gemv, fp8_dot_gemv_reference
from slipstream.kernels.pdl import pdl_release, pdl_wait
from slipstream.kernels.tuning import graph_time_us, weight_copies

logger = logging.getLogger(__name__)

QUANT_WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)
# SLIPSTREAM_FP8_ACT_GEMV=0 keeps small-batch FP8 layers on bf16 activations (no activation
# rounding; Llama-3.1-8B fp8 decode at batch 4-16 was 1.5-1.7x slower that way on the H200).
_FP8_ACT_GEMV = os.environ.get("SLIPSTREAM_FP8_ACT_GEMV", "1") != "0"
# gemv.TUNE_GATED (SLIPSTREAM_TUNE_GATED=0 turns it off): the down projection's gated calls get
# their own measured choice, fused (SiLU·up computed as the kernel loads x) or unfused (the
# activation kernel, then the plain GEMV); sm_90 SASS shows the fused loop at 2.2x the plain
# one's instructions at M=1 (every N tile recomputes SiLU over its K range).
_TUNE_GATED = _gemv.TUNE_GATED


@triton.jit
def _to_float(w, BIT_CONVERT: tl.constexpr):
    """w as float32 (BIT_CONVERT 2: times 2^-120), converted without conversion instructions when
    BIT_CONVERT is set (int->float and fp8->float converts run at a fraction of the FMA rate).

    1 (int8): bits b ^ 0x4B000080 read as float32 are 2^23 + 128 + value.
    2 (fp8 e4m3): sign to bit 31, exponent and mantissa to bits 20-26: e4m3's value times 2^-120
    (subnormals land on float32 subnormals, the same scaling); the caller multiplies back.
    3 (int8, CUDA only): the same float as 1, one PRMT per value from four packed bytes.
    """
    if BIT_CONVERT == 3:
        return _int8x4_to_float(w)
    elif BIT_CONVERT == 1:
        bits = w.to(tl.uint8, bitcast=True).to(tl.uint32) ^ 0x4B000080
        return bits.to(tl.float32, bitcast=True) - 8388736.0
    elif BIT_CONVERT == 2:
        b = w.to(tl.uint8, bitcast=True).to(tl.uint32)
        bits = ((b & 0x80) << 24) | ((b & 0x7F) << 20)
        return bits.to(tl.float32, bitcast=True)
    else:
        return w.to(tl.float32)


@triton.jit
def _int8x4_to_float(w):
    """int8 -> float32 as BIT_CONVERT 1 computes it, in fewer instructions: one XOR flips the
    sign bits of four packed bytes, then one byte permute per value builds the float bits
    0x4B0000uu (2^23 + uu); the subtraction leaves the value. Inline PTX: GPU only."""
    f = tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t;
        xor.b32 t, $4, 0x80808080;
        prmt.b32 $0, t, 0x4B000000, 0x7540;
        prmt.b32 $1, t, 0x4B000000, 0x7541;
        prmt.b32 $2, t, 0x4B000000, 0x7542;
        prmt.b32 $3, t, 0x4B000000, 0x7543;
        }""",
        constraints="=r,=r,=r,=r,r", args=[w], dtype=tl.float32, is_pure=True, pack=4)
    return f - 8388736.0


@triton.jit(do_not_specialize=["M", "split_k"])
def _qgemv_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
                  stride_wn, stride_om, k_per_split, split_k, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                  HAS_BIAS: tl.constexpr, PREFETCH: tl.constexpr, BIT_CONVERT: tl.constexpr,
                  GATED: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                  STAGES: tl.constexpr = 1, GATE_OUT: tl.constexpr = False):
    """M == 1: products into a 2-D float32 accumulator, one reduction and one scale at the end.
    STAGES > 1 (without PREFETCH): weight tiles stream through shared memory, STAGES - 1 ahead
    (asynchronous copies), so the bytes in flight do not cost registers. GATE_OUT: see
    gemv._tile_rows."""
    pdl_release(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = _tile_rows(pid_n, N, BLOCK_N, GATE_OUT)
    offs_k = tl.arange(0, BLOCK_K)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    if PREFETCH:
        w_next = _load_w_tile(w_ptrs, k_lo, k_lo, k_hi, offs_k, EVEN_K, BLOCK_K)
    pdl_wait(USE_PDL)  # the first weight tile is already in flight (kernels/pdl.py)
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        if PREFETCH:
            w = w_next
            w_next = _load_w_tile(w_ptrs, k + BLOCK_K, k_lo, k_hi, offs_k, EVEN_K, BLOCK_K)
        else:
            w = _load_w_tile(w_ptrs, k, k_lo, k_hi, offs_k, EVEN_K, BLOCK_K)
        x = _load_x(x_ptr + k + offs_k, k + offs_k < k_hi, K, GATED, EVEN_K)
        xf = x.to(tl.float32)
        if BIT_CONVERT == 2:
            xf = xf * 1.2676506002282294e30  # 2^100: products of 2^-120-scaled weights stay normal
        acc += _to_float(w, BIT_CONVERT) * xf[None, :]
    scale = tl.load(s_ptr + rows)
    if BIT_CONVERT == 2:
        scale = scale * 1048576.0  # 2^20: with x's 2^100, undoes the 2^-120
    if GATE_OUT:
        _finish_gate_out(tl.sum(acc, 1) * scale, rows, ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n,
                         pid_k, N, split_k, SPLIT, HAS_BIAS, BLOCK_N)
    else:
        part = (tl.sum(acc, 1) * scale)[None, :]
        offs_m = tl.arange(0, 1)
        _finish(part, ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k, offs_m, offs_n, M, N,
                stride_om, split_k, SPLIT, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "split_k"])
def _qskinny_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
                    stride_wn, stride_om, k_per_split, split_k, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
                    GATED: tl.constexpr = False, USE_PDL: tl.constexpr = False,
                    ANCHOR_GATED: tl.constexpr = False):
    """1 < M <= 16: weight tile converted to x's dtype, then a tensor-core product per step."""
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
    w_ptrs = w_ptr + rows[None, :] * stride_wn + offs_k[:, None]
    x_ptrs = x_ptr + x_rows[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        k_ok = k + offs_k < k_hi
        if EVEN_K:
            w = tl.load(w_ptrs + k)
        else:
            w = tl.load(w_ptrs + k, mask=k_ok[:, None], other=0.0)
        x = _load_x(x_ptrs + k, k_ok[None, :], K, GATED, EVEN_K, ANCHOR_GATED)
        # INT8 and FP8 E4M3 values are exact in bf16 / fp16 / fp32.
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PREC)
    scale = tl.load(s_ptr + rows)
    _finish(acc * scale[None, :], ws_ptr, cnt_ptr, bias_ptr, out_ptr, pid_n, pid_k, offs_m,
            offs_n, M, N, stride_om, split_k, SPLIT, HAS_BIAS)


def default_qconfig(m: int) -> GemvConfig:
    """One-byte weights: twice gemv's K tile at M == 1 keeps the bytes per load the same."""
    if m == 1:
        return GemvConfig(block_n=8, block_k=1024, num_warps=4, prefetch=True)
    return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)


def candidate_qconfigs(m: int, weight_dtype: torch.dtype = torch.int8) -> list[GemvConfig]:
    """The few configs qlinear_small measures per shape (each one a compile at start-up)."""
    if m == 1:  # (block_n, block_k, split_k, num_warps, prefetch); split_k 0: from the shape
        tiles = [(8, 1024, 0, 4, True), (16, 1024, 0, 4, False), (8, 2048, 0, 8, False),
                 (32, 512, 0, 4, True), (4, 2048, 0, 4, False), (16, 512, 0, 4, True),
                 # Narrow tiles without split: more programs in flight for N of 4-6k (o, qkv).
                 (4, 1024, 1, 2, True), (4, 512, 1, 2, True), (8, 512, 1, 4, True)]
        cfgs = [GemvConfig(bn, bk, sk, w, 1, pf) for bn, bk, sk, w, pf in tiles]
        # The same tiles with bit-trick conversion, and a few tensor-core (tl.dot) variants.
        dots = [GemvConfig(bn, bk, 0, w, st, dot=True) for bn, bk, w, st in
                [(64, 128, 4, 4), (32, 256, 4, 3), (32, 128, 4, 4)]]
        tricks = [dataclasses.replace(c, bit_convert=1) for c in cfgs]
        if weight_dtype == torch.int8:  # the byte-permute conversion (int8 only)
            tricks += [dataclasses.replace(c, bit_convert=2) for c in cfgs]
        # Tiles streamed through shared memory (tl.range stages) with the conversion that
        # needs the fewest instructions per weight (sm_90 SASS: int8 byte permutes, fp8 the
        # hardware e4m3x2 -> f16x2 convert): ~96 KB per SM in flight instead of ~32-48 KB.
        bits = 2 if weight_dtype == torch.int8 else 0
        staged = [GemvConfig(bn, bk, 0, w, st, bit_convert=bits) for bn, bk, w, st in
                  [(8, 1024, 4, 4), (16, 512, 4, 4), (4, 1024, 2, 4), (8, 512, 4, 4),
                   (4, 2048, 4, 3)]]
        return cfgs + tricks + staged + dots + _fp8_act_configs(weight_dtype)
    tiles = [(64, 128, 4, 4), (32, 128, 4, 4), (64, 256, 4, 3), (32, 256, 4, 3)]
    return [GemvConfig(bn, bk, 0, w, st) for bn, bk, w, st in tiles] + _fp8_act_configs(weight_dtype)


def _fp8_act_configs(weight_dtype: torch.dtype) -> list[GemvConfig]:
    """FP8 weights: the tensor-core kernel with FP8 activations (kernels/gemv_fp8.py), tiles of
    64-256 weight rows (one or two warp groups) by 128-256 columns (~1.2-2 sm_90 instructions per
    weight against the dequant kernels' ~4.75)."""
    if weight_dtype != torch.float8_e4m3fn or not _FP8_ACT_GEMV:
        return []
    return [GemvConfig(bn, bk, 0, w, st, fp8_act=True) for bn, bk, w, st in
            [(64, 128, 4, 4), (128, 128, 4, 4), (128, 128, 8, 4), (256, 128, 8, 4),
             (128, 256, 4, 3), (256, 256, 8, 2)]]


_QCHOICES: dict[tuple, GemvConfig] = {}


def qlinear_small(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None, gated: bool = False,
                  act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """qgemv with a config measured once per (M bucket, N, K, dtypes) on CUDA. gated (see
    qgemv): the plain product's measured config; with gemv.TUNE_GATED and `act` (the
    activation the gated kernel computes), a choice measured for the gated call itself, which
    may be to run act first and then the plain product."""
    if gated and act is not None and _TUNE_GATED:
        cfg = _gated_choice(x, qweight, scale, bias, act)
        if cfg is _UNFUSED:
            return qlinear_small(act(x), qweight, scale, bias)
        if cfg is not None:
            return qgemv(x, qweight, scale, bias, cfg, gated=True)
    return qgemv(x, qweight, scale, bias, measured_qconfig(x, qweight, scale, bias), gated=gated)


def qlinear_small_gate_out(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """silu_and_mul of qlinear_small's product in one launch, for one row of x and a
    [gate | up] weight whose measured config is a one-row dequant GEMV; else None."""
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not x.is_cuda or m != 1:
        return None
    cfg = measured_qconfig(x, qweight, scale, bias)
    if not gate_out_ok(m, qweight.shape[0], cfg):
        return None
    return qgemv_gate_out(x, qweight, scale, bias, cfg)


_UNFUSED = GemvConfig(0, 0)  # a gated choice: the activation kernel, then the plain product
_GATED_CHOICES: dict[tuple, GemvConfig] = {}


def _gated_choice(gate_up: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None, act) -> GemvConfig | None:
    """The measured choice for a gated call of this shape (None: not measurable now, use the
    plain product's config fused)."""
    m = gate_up.numel() // gate_up.shape[-1]
    bucket = 1 if m == 1 else 4 if m <= 4 else MAX_M
    key = (bucket, qweight.shape[0], qweight.shape[1], gate_up.dtype, qweight.dtype,
           gate_up.device.index)
    cfg = _GATED_CHOICES.get(key)
    if cfg is None:
        if not gate_up.is_cuda or torch.cuda.is_current_stream_capturing():
            return None
        cfg = _GATED_CHOICES[key] = _measure_gated(bucket, qweight, scale, bias, gate_up.dtype,
                                                   act)
    return cfg


def _measure_gated(m: int, qweight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None, dtype: torch.dtype, act) -> GemvConfig:
    """Time act-then-plain (the plain product's measured config) against each candidate run
    gated; the fastest correct one (_UNFUSED for the former)."""
    k = qweight.shape[1]
    gate_up = torch.randn((m, 2 * k), device=qweight.device, dtype=dtype)
    plain = measured_qconfig(gate_up[:, :k], qweight, scale, bias)
    expect = qgemv_reference(act(gate_up), qweight, scale, bias).float()
    arg_sets = weight_copies((gate_up, qweight, scale) if bias is None
                             else (gate_up, qweight, scale, bias))
    best = _UNFUSED
    best_us = graph_time_us(lambda a: qgemv(act(a[0]), *a[1:], config=plain), arg_sets)
    for cfg in candidate_qconfigs(m, qweight.dtype):
        want = expect
        if cfg.fp8_act:
            want = fp8_dot_gemv_reference(gate_up, qweight, scale, bias, cfg.block_k,
                                          gated=True).float()
        try:
            got = qgemv(gate_up, qweight, scale, bias, cfg, gated=True).float()
            if not torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item()):
                continue
            us = graph_time_us(lambda a, cfg=cfg: qgemv(*a, config=cfg, gated=True), arg_sets)
        except Exception:  # e.g. out of shared memory for this tile
            continue
        if us < best_us:
            best, best_us = cfg, us
    logger.info("qgemv gated M<=%d N=%d K=%d %s: %s (%.1f us)", m, qweight.shape[0], k,
                qweight.dtype, "unfused" if best is _UNFUSED else best, best_us)
    return best


def measured_qconfig(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> GemvConfig | None:
    """The config qlinear_small runs for x's row count and this weight (measured on first use
    on CUDA; None off CUDA or while capturing a graph before it was measured: the default)."""
    k = qweight.shape[1]
    m = x.numel() // x.shape[-1]
    bucket = 1 if m == 1 else 4 if m <= 4 else MAX_M
    key = (bucket, qweight.shape[0], k, x.dtype, qweight.dtype, x.device.index)
    cfg = _QCHOICES.get(key)
    if cfg is None:
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return None
        cfg = _QCHOICES[key] = _measure(bucket, qweight, scale, bias, x.dtype)
    return cfg


def _measure(m: int, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             dtype: torch.dtype) -> GemvConfig:
    x = torch.randn((m, qweight.shape[1]), device=qweight.device, dtype=dtype)
    expect = qgemv_reference(x, qweight, scale, bias).float()
    arg_sets = weight_copies((x, qweight, scale) if bias is None else (x, qweight, scale, bias))
    best, best_us = default_qconfig(m), float("inf")
    for cfg in candidate_qconfigs(m, qweight.dtype):
        want = expect
        if cfg.fp8_act:  # its own oracle: the activations it quantizes are part of its result
            want = fp8_dot_gemv_reference(x, qweight, scale, bias, cfg.block_k).float()
        tol = 2e-2 * want.abs().max().item()
        try:
            got = qgemv(x, qweight, scale, bias, cfg).float()
            if not torch.allclose(got, want, rtol=2e-2, atol=tol):
                continue  # a miscompiled config must never be chosen
            us = graph_time_us(lambda a, cfg=cfg: qgemv(*a, config=cfg), arg_sets)
        except Exception:  # e.g. out of shared memory for this tile
            continue
        if us < best_us:
            best, best_us = cfg, us
    logger.info("qgemv M<=%d N=%d K=%d %s: %s (%.1f us)", m, qweight.shape[0], qweight.shape[1],
                qweight.dtype, best, best_us)
    return best


def qgemv_gate_out(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None, cfg: GemvConfig) -> torch.Tensor:
    """silu_and_mul(x @ (q * scale)^T (+ bias)) for one row of x and a [gate | up] weight, in
    one launch of the M == 1 kernel (gemv.gate_out_ok configs)."""
    x2, m, n, k = _gemv_operands(x, qweight, False)
    if qweight.dtype not in QUANT_WEIGHT_DTYPES or not gate_out_ok(m, n, cfg):
        raise ValueError(f"qgemv_gate_out needs one row, an even N, a one-row config and an "
                         f"int8 / fp8 weight; got M={m}, N={n}, {qweight.dtype}, {cfg}")
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    scale = scale.float().contiguous()
    out = torch.empty((1, n // 2), dtype=x.dtype, device=x.device)
    split, per_split, n_tiles, ws, cnt = gate_out_launch(cfg, n, k, x.device)
    _qgemv_kernel[(n_tiles, split)](
        x2, qweight, scale, bias if bias is not None else out, out, ws, cnt, 1, n, k,
        x2.stride(0), qweight.stride(0), out.stride(0), per_split, split, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLIT=split > 1, EVEN_K=k % cfg.block_k == 0,
        HAS_BIAS=bias is not None, PREFETCH=cfg.prefetch,
        BIT_CONVERT=_bit_convert_mode(cfg, qweight.dtype, x.is_cuda), STAGES=cfg.num_stages,
        GATE_OUT=True, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.launch_kwargs(x.device))
    return out.view(*x.shape[:-1], n // 2)


def qgemv(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
          bias: torch.Tensor | None = None, config: GemvConfig | None = None,
          gated: bool = False) -> torch.Tensor:
    """x [..., K] @ (qweight [N, K] * scale [N, 1])^T (+ bias), at most MAX_M rows of x.

    gated: x is [..., 2K] = [gate | up] and the product is silu(gate) * up @ weight^T.
    """
    if qweight.dtype not in QUANT_WEIGHT_DTYPES:
        raise TypeError(f"qgemv: weight dtype {qweight.dtype} is not one of {QUANT_WEIGHT_DTYPES}")
    if config is not None and config.fp8_act:
        return fp8_dot_gemv(x, qweight, scale, bias, config, gated=gated)
    x2, m, n, k = _gemv_operands(x, qweight, gated)
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    scale = scale.float().contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    cfg = config or default_qconfig(m)
    split, per_split, n_tiles, ws, cnt = split_buffers(cfg, m, n, k, out)
    b = bias if bias is not None else out
    common = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1,
                  EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None, GATED=gated,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args = (x2, qweight, scale, b, out, ws, cnt, m, n, k, x2.stride(0), qweight.stride(0),
            out.stride(0), per_split, split)
    if m == 1 and not cfg.dot:
        bit_convert = _bit_convert_mode(cfg, qweight.dtype, x.is_cuda)
        _qgemv_kernel[(n_tiles, split)](*args, PREFETCH=cfg.prefetch, BIT_CONVERT=bit_convert,
                                        STAGES=cfg.num_stages, **common,
                                        **pdl.launch_kwargs(x.device))
    else:
        prec = "ieee" if x.dtype == torch.float32 else "tf32"
        anchor = gated and x.is_cuda and _gemv.TUNE_GATED
        _qskinny_kernel[(n_tiles, split)](*args, BLOCK_M=16, DOT_PREC=prec, **common,
                                          ANCHOR_GATED=anchor, **pdl.launch_kwargs(x.device))
    return out.view(*x.shape[:-1], n)


def _bit_convert_mode(cfg: GemvConfig, weight_dtype: torch.dtype, on_cuda: bool) -> int:
    """The kernel's BIT_CONVERT for a config: 0 conversion instructions, 1 / 2 the int8 / fp8 bit
    tricks, 3 the int8 byte permute (inline PTX: the interpreter runs 1 instead)."""
    if not cfg.bit_convert:
        return 0
    if weight_dtype != torch.int8:
        return 2
    return 3 if cfg.bit_convert == 2 and on_cuda else 1


def qgemv_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-torch twin: dequantize, then F.linear in float32."""
    w = qweight.float() * scale.float()[:, None]
    out = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)
