"""Triton dequant-GEMV for decode: out = x @ (q * scale[:, None])^T (+ bias), M <= 16.

The weight q [N, K] is INT8 (or FP8 E4M3) with one float32 scale per output channel. It is read
once, converted in registers, and the scale is applied to each program's partial sum (the scale
does not depend on k). The kernels are kernels/gemv.py's with HAS_SCALE (split-K and its
in-kernel reduction included); this module holds the tile candidates and the measured choice.
"""
from __future__ import annotations

import dataclasses

import torch
import triton

from slipstream.kernels import pdl
from slipstream.kernels.gemv import (
    MAX_M,
    GemvConfig,
    _counters,
    _gemv_kernel,
    _gemv_operands,
    _skinny_kernel,
    _split_k,
)
from slipstream.kernels.tuning import graph_time_us, weight_copies

QUANT_WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)


def default_qconfig(m: int) -> GemvConfig:
    """One-byte weights: twice gemv's K tile at M == 1 keeps the bytes per load the same."""
    if m == 1:
        return GemvConfig(block_n=8, block_k=1024, num_warps=4, prefetch=True)
    return GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)


def candidate_qconfigs(m: int) -> list[GemvConfig]:
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
        return cfgs + [dataclasses.replace(c, bit_convert=True) for c in cfgs] + dots
    tiles = [(64, 128, 4, 4), (32, 128, 4, 4), (64, 256, 4, 3), (32, 256, 4, 3)]
    return [GemvConfig(bn, bk, 0, w, st) for bn, bk, w, st in tiles]


_QCHOICES: dict[tuple, GemvConfig] = {}


def qlinear_small(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """qgemv with a config measured once per (M bucket, N, K, dtypes) on CUDA (gated: see qgemv;
    it shares the plain product's measured config)."""
    k = qweight.shape[1]
    m = x.numel() // x.shape[-1]
    bucket = 1 if m == 1 else 4 if m <= 4 else MAX_M
    key = (bucket, qweight.shape[0], k, x.dtype, qweight.dtype, x.device.index)
    cfg = _QCHOICES.get(key)
    if cfg is None:
        if not x.is_cuda or torch.cuda.is_current_stream_capturing():
            return qgemv(x, qweight, scale, bias, gated=gated)
        cfg = _QCHOICES[key] = _measure(bucket, qweight, scale, bias, x.dtype)
    return qgemv(x, qweight, scale, bias, cfg, gated=gated)


def _measure(m: int, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             dtype: torch.dtype) -> GemvConfig:
    x = torch.randn((m, qweight.shape[1]), device=qweight.device, dtype=dtype)
    expect = qgemv_reference(x, qweight, scale, bias).float()
    tol = 2e-2 * expect.abs().max().item()
    arg_sets = weight_copies((x, qweight, scale) if bias is None else (x, qweight, scale, bias))
    best, best_us = default_qconfig(m), float("inf")
    for cfg in candidate_qconfigs(m):
        try:
            got = qgemv(x, qweight, scale, bias, cfg).float()
            if not torch.allclose(got, expect, rtol=2e-2, atol=tol):
                continue  # a miscompiled config must never be chosen
            us = graph_time_us(lambda a, cfg=cfg: qgemv(*a, config=cfg), arg_sets)
        except Exception:  # e.g. out of shared memory for this tile
            continue
        if us < best_us:
            best, best_us = cfg, us
    return best


def qgemv(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
          bias: torch.Tensor | None = None, config: GemvConfig | None = None,
          gated: bool = False) -> torch.Tensor:
    """x [..., K] @ (qweight [N, K] * scale [N, 1])^T (+ bias), at most MAX_M rows of x.

    gated: x is [..., 2K] = [gate | up] and the product is silu(gate) * up @ weight^T.
    """
    if qweight.dtype not in QUANT_WEIGHT_DTYPES:
        raise TypeError(f"qgemv: weight dtype {qweight.dtype} is not one of {QUANT_WEIGHT_DTYPES}")
    x2, m, n, k = _gemv_operands(x, qweight, gated)
    qweight = qweight if qweight.stride(-1) == 1 else qweight.contiguous()
    scale = scale.float().contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*x.shape[:-1], n)
    cfg = config or default_qconfig(m)
    split, per_split = _split_k(cfg, n, k, x.device)
    n_tiles = triton.cdiv(n, cfg.block_n)
    ws = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    cnt = _counters(x.device, n_tiles) if split > 1 else out
    b = bias if bias is not None else out
    common = dict(BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1,
                  EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None, GATED=gated,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                  **pdl.launch_kwargs(x.device))
    args = (x2, qweight, scale, b, out, ws, cnt, m, n, k, x2.stride(0), qweight.stride(0),
            out.stride(0), per_split, split)
    if m == 1 and not cfg.dot:
        bit_convert = (1 if qweight.dtype == torch.int8 else 2) if cfg.bit_convert else 0
        _gemv_kernel[(n_tiles, split)](*args, PREFETCH=cfg.prefetch, BIT_CONVERT=bit_convert,
                                       HAS_SCALE=True, **common)
    else:
        prec = "ieee" if x.dtype == torch.float32 else "tf32"
        _skinny_kernel[(n_tiles, split)](*args, BLOCK_M=16, DOT_PREC=prec, HAS_SCALE=True,
                                         **common)
    return out.view(*x.shape[:-1], n)


def qgemv_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-torch twin: dequantize, then F.linear in float32."""
    w = qweight.float() * scale.float()[:, None]
    out = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)
