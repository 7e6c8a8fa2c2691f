"""Triton dequant-GEMV for decode: out = x @ (q * scale[:, None])^T (+ bias), M <= 16.

The weight q [N, K] is INT8 (or FP8 E4M3) with one float32 scale per output channel. It is read
once, converted in registers, and the scale is applied to each program's partial sum (the scale
does not depend on k). Split-K and its in-kernel reduction are those of kernels/gemv/dense.py.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
import triton

from slipstream.kernels.gemv import dense as _gemv
from slipstream.kernels.gemv.dense import (
    MAX_M,
    GemvConfig,
    call_kind,
    gate_out_ok,
    gemv_operands,
    split_buffers,
)
from slipstream.kernels.gemv.fp8 import fp8_dot_gemv, fp8_dot_gemv_reference
from slipstream.kernels.reference import silu_and_mul
from slipstream.kernels.runtime import pdl, tuning_cache
from slipstream.kernels.runtime.tuning import graph_time_us, weight_copies

logger = logging.getLogger(__name__)

QUANT_WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)
# The down projection's gated calls get their own measured choice, fused (SiLU·up computed as
# the kernel loads x) or unfused (the activation kernel, then the plain GEMV): the fused loop
# runs 2.2x the plain one's instructions at M=1 (every N tile recomputes SiLU over its K range),
# so neither wins every shape.


def default_qconfig(m: int) -> GemvConfig:
    """One-byte weights: twice gemv's K tile at M == 1 keeps the bytes per load the same."""
    if m == 1:
        return GemvConfig(block_n=8, block_k=1024, num_warps=4, prefetch=True)
    return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)


def candidate_qconfigs(m: int, weight_dtype: torch.dtype = torch.int8,
                       k: int | None = None) -> list[GemvConfig]:
    """The few configs qlinear_small measures per shape (each one a compile at start-up); k:
    the shape's K, for the one-row tiles that span it (up to 4,096)."""
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
        return cfgs + tricks + staged + _whole_k_configs(k, bits) + dots + _fp8_act_configs(weight_dtype)
    tiles = [(64, 128, 4, 4), (32, 128, 4, 4), (64, 256, 4, 3), (32, 256, 4, 3)]
    return [GemvConfig(bn, bk, 0, w, st) for bn, bk, w, st in tiles] + _fp8_act_configs(weight_dtype)


def _whole_k_configs(k: int | None, bit_convert: int) -> list[GemvConfig]:
    """One-row tiles holding a program's whole weight slice in registers, requested before the
    PDL wait (gemv.whole_k): K up to 4,096 one-byte weights, 4-8 rows a program (16-32 KB)."""
    if k is None or k > 4096:
        return []
    block_k = max(triton.next_power_of_2(k), 16)
    return [GemvConfig(bn, block_k, 1, w, 1, True, bit_convert=bit_convert)
            for bn, w in [(4, 2), (4, 4), (8, 4)]]


def _fp8_act_configs(weight_dtype: torch.dtype) -> list[GemvConfig]:
    """FP8 weights: the tensor-core kernel with FP8 activations (kernels/gemv/fp8.py), tiles of
    64-256 weight rows (one or two warp groups) by 128-256 columns (~1.2-2 sm_90 instructions per
    weight against the dequant kernels' ~4.75)."""
    if weight_dtype != torch.float8_e4m3fn:
        return []
    return [GemvConfig(bn, bk, 0, w, st, fp8_act=True) for bn, bk, w, st in
            [(64, 128, 4, 4), (128, 128, 4, 4), (128, 128, 8, 4), (256, 128, 8, 4),
             (128, 256, 4, 3), (256, 256, 8, 2)]]


_QCHOICES: dict[tuple, GemvConfig] = tuning_cache.register("gemv.int8", {})


def qlinear_small(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None, gated: bool = False,
                  act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """qgemv with a config measured once per (M bucket, N, K, dtypes) on CUDA. gated (see
    qgemv): the plain product's measured config; with `act` (the
    activation the gated kernel computes), a choice measured for the gated call itself, which
    may be to run act first and then the plain product."""
    if gated and act is not None:
        cfg = _gated_choice(x, qweight, scale, bias, act)
        if cfg == _UNFUSED:  # equal, not identical: a choice may come from the tuning cache
            return qlinear_small(act(x), qweight, scale, bias)
        if cfg is not None:
            return qgemv(x, qweight, scale, bias, cfg, gated=True)
    return qgemv(x, qweight, scale, bias, measured_qconfig(x, qweight, scale, bias), gated=gated)


def qlinear_small_gate_out(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None, rms_eps: float = 0.0
                           ) -> torch.Tensor | None:
    """silu_and_mul of qlinear_small's product in one launch, for one row of x on CUDA and a
    [gate | up] weight, with the config measured for this gate-out call (rms_eps > 0: of
    x / rms(x), see qlinear_small_rms); else None (the caller runs the product, then the
    activation)."""
    cfg = _one_row_kind_qconfig(x, qweight, scale, bias, True, rms_eps)
    if cfg is None:
        return None
    return qgemv_gate_out(x, qweight, scale, bias, cfg, rms_eps)


def qlinear_small_rms(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None, eps: float) -> torch.Tensor | None:
    """qlinear_small of x / rms(x) in one launch for one row of x on CUDA (an RMSNorm whose
    weight is folded into the weight, models/norm_fold.py), with the config measured for that
    call; else None (the caller runs the norm kernel first)."""
    cfg = _one_row_kind_qconfig(x, qweight, scale, bias, False, eps)
    if cfg is None:
        return None
    return qgemv(x, qweight, scale, bias, cfg, rms_eps=eps)


# One-row gate-out / in-GEMV norm calls, measured as they run, each among the configs that run
# them (a config's gate-out need not rank as its plain product does, so the plain product's
# pick need not be theirs). None: no candidate runs the call.
_KIND_QCHOICES: dict[tuple, GemvConfig | None] = tuning_cache.register("gemv.int8.kind", {})


def _one_row_kind_qconfig(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None, gate_out: bool, rms_eps: float
                          ) -> GemvConfig | None:
    """The config measured for a one-row gate-out and / or norm call of this shape (None off
    CUDA, for more rows, while capturing a graph before it was measured, or where no config
    runs it)."""
    k = x.shape[-1]
    if not x.is_cuda or not k or x.numel() != k:
        return None
    key = (qweight.shape[0], k, x.dtype, qweight.dtype, bias is not None, x.device.index,
           call_kind(gate_out, rms_eps))
    if key not in _KIND_QCHOICES:
        if torch.cuda.is_current_stream_capturing():
            return None
        _KIND_QCHOICES[key] = _measure_kind(qweight, scale, bias, x.dtype, gate_out, rms_eps)
    return _KIND_QCHOICES[key]


def _runs_kind(cfg: GemvConfig, n: int, k: int, device: torch.device, gate_out: bool,
               rms_eps: float) -> bool:
    """Whether a candidate runs this one-row call as itself."""
    return ((not gate_out or gate_out_ok(1, n, cfg))
            and (not rms_eps or _gemv.rms_ok(1, n, k, cfg, device)))


def _kind_call(cfg: GemvConfig, gate_out: bool, rms_eps: float):
    """(x, qweight, scale[, bias]) -> the one-row call _measure_kind times for cfg."""
    if gate_out:
        return lambda x, q, s, b=None: qgemv_gate_out(x, q, s, b, cfg, rms_eps)
    return lambda x, q, s, b=None: qgemv(x, q, s, b, cfg, rms_eps=rms_eps)


def _measure_kind(qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                  dtype: torch.dtype, gate_out: bool, rms_eps: float) -> GemvConfig | None:
    """The fastest correct candidate for the one-row call (timed as _measure times the plain
    product), or None when none runs it."""
    n, k = qweight.shape
    x = torch.randn((1, k), device=qweight.device, dtype=dtype)
    xr = x.float()
    if rms_eps:
        xr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + rms_eps)
    want = qgemv_reference(xr, qweight, scale, bias).float()
    if gate_out:
        want = silu_and_mul(want)
    cands = [(cfg, _kind_call(cfg, gate_out, rms_eps), want)
             for cfg in candidate_qconfigs(1, qweight.dtype, k)
             if _runs_kind(cfg, n, k, qweight.device, gate_out, rms_eps)]
    best, best_us = _fastest_correct(cands, x, qweight, scale, bias, None)
    logger.info("qgemv M<=1 N=%d K=%d %s %s: %s (%.1f us)", n, k, qweight.dtype,
                call_kind(gate_out, rms_eps), best, best_us)
    return best


def _fastest_correct(cands: list, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None, fallback):
    """(config, us) of the fastest candidate whose call(x, qweight, scale[, bias]) matches its
    oracle (cands: (config, call, want)), graph-timed over L2-sized weight copies; (fallback,
    inf) when none does. A miscompiled or failing config (e.g. out of shared memory for its
    tile) is never chosen."""
    args = (x, qweight, scale) if bias is None else (x, qweight, scale, bias)
    arg_sets = weight_copies(args)
    best, best_us = fallback, float("inf")
    for cfg, call, want in cands:
        try:
            if not torch.allclose(call(*args).float(), want, rtol=2e-2,
                                  atol=2e-2 * want.abs().max().item()):
                continue
            us = graph_time_us(lambda a, call=call: call(*a), arg_sets)
        except Exception:  # e.g. out of shared memory for this tile
            continue
        if us < best_us:
            best, best_us = cfg, us
    return best, best_us


_UNFUSED = GemvConfig(0, 0)  # a gated choice: the activation kernel, then the plain product
_GATED_CHOICES: dict[tuple, GemvConfig] = tuning_cache.register("gemv.int8.gated", {})


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
    for cfg in candidate_qconfigs(m, qweight.dtype, qweight.shape[1]):
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
                qweight.dtype, "unfused" if best == _UNFUSED else best, best_us)
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
    cands = []
    for cfg in candidate_qconfigs(m, qweight.dtype, qweight.shape[1]):
        want = expect
        if cfg.fp8_act:  # its own oracle: the activations it quantizes are part of its result
            want = fp8_dot_gemv_reference(x, qweight, scale, bias, cfg.block_k).float()
        cands.append((cfg, lambda *a, cfg=cfg: qgemv(*a, config=cfg), want))
    best, best_us = _fastest_correct(cands, x, qweight, scale, bias, default_qconfig(m))
    logger.info("qgemv M<=%d N=%d K=%d %s: %s (%.1f us)", m, qweight.shape[0], qweight.shape[1],
                qweight.dtype, best, best_us)
    return best


def qgemv_gate_out(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None, cfg: GemvConfig, rms_eps: float = 0.0
                   ) -> torch.Tensor:
    """silu_and_mul(x @ (q * scale)^T (+ bias)) for one row of x and a [gate | up] weight, in
    one launch of the M == 1 kernel (gemv.gate_out_ok configs); rms_eps: see qgemv."""
    if qweight.dtype not in QUANT_WEIGHT_DTYPES:
        raise ValueError(f"qgemv_gate_out needs an int8 / fp8 weight; got {qweight.dtype}")
    return _gemv.gemv_gate_out(x, qweight, bias, cfg, scale.float().contiguous(),
                                _bit_convert_mode(cfg, qweight.dtype, x.is_cuda), rms_eps)


def qgemv(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
          bias: torch.Tensor | None = None, config: GemvConfig | None = None,
          gated: bool = False, rms_eps: float = 0.0) -> torch.Tensor:
    """x [..., K] @ (qweight [N, K] * scale [N, 1])^T (+ bias), at most MAX_M rows of x.

    gated: x is [..., 2K] = [gate | up] and the product is silu(gate) * up @ weight^T.
    rms_eps > 0 (one row, gemv.rms_ok config): the product is taken with x / rms(x), as gemv's.
    """
    if qweight.dtype not in QUANT_WEIGHT_DTYPES:
        raise TypeError(f"qgemv: weight dtype {qweight.dtype} is not one of {QUANT_WEIGHT_DTYPES}")
    if config is not None and config.fp8_act and not rms_eps:
        return fp8_dot_gemv(x, qweight, scale, bias, config, gated=gated)
    x2, qweight, m, n, k = gemv_operands(x, qweight, gated)
    if rms_eps and (m != 1 or gated or (config is not None and (config.dot or config.fp8_act))):
        raise ValueError(f"rms_eps needs one row of a plain input and a one-row config; got "
                         f"M={m}, gated={gated}, {config}")
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
        _gemv.gemv_kernel[(n_tiles, split)](*args, **_gemv.one_row_path(cfg, k, split, rms_eps),
                                             HAS_SCALE=True, BIT_CONVERT=bit_convert, **common,
                                             **pdl.launch_kwargs(x.device))
    else:
        prec = "ieee" if x.dtype == torch.float32 else "tf32"
        anchor = gated and x.is_cuda
        _gemv.skinny_kernel[(n_tiles, split)](*args, BLOCK_M=16, DOT_PREC=prec, **common,
                                               ANCHOR_GATED=anchor, HAS_SCALE=True,
                                               **pdl.launch_kwargs(x.device))
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
