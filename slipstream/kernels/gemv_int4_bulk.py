"""One-row int4_awq GEMV in CUDA C++ (w4_bulk.cu): a producer warp streams 16-row tiles into a
shared-memory ring with bulk asynchronous copies, consumer warps sum on the tensor cores (x as
an exact split into int8 halves, a 15-bit fixed point a group of 128; split_int8_x and
w4_split_int8_reference are its plain-torch twin). Plain, with bias, with the folded RMSNorm
(rms_eps) and as a gate-out. CUDA only (NVRTC, kernels/cuda_launch.py), groups of 128.

Opt-in: SLIPSTREAM_W4_BULK=1 routes int4_awq's one-row calls with K <= 4096 (qkv, o, gate_up,
not down: its x would not fit in registers) here instead of the Triton kernels' tuner
(maybe_bulk); benchmarks/probe_w4_bulk.py times it against them.
"""
from __future__ import annotations

import os

import torch

from slipstream.kernels.cuda_launch import compile_kernel
from slipstream.kernels.gemv import num_sms
from slipstream.kernels.int4_common import cuda_one_row_call, cuda_one_row_operands

ENABLED = os.environ.get("SLIPSTREAM_W4_BULK", "0") == "1"
ROWS = 16
GROUP = 128
MAX_GROUPS_A_WARP = 4  # x of 4 groups is 64 registers a lane; more spill
STAGES = 6  # 16-row tiles in flight an SM: ~210 KB of shared memory at K = 4096


def stage_bytes(k: int) -> int:
    """One ring stage: 16 padded weight rows, their fp16 scales and uint8 zeros (w4_bulk.cu)."""
    ng = k // GROUP
    raw = ROWS * (k // 2 + 64) + ROWS * ng * 2 + ROWS * ng
    return -(-raw // 128) * 128


def shared_bytes(k: int, cwarps: int, stages: int) -> int:
    """The kernel's dynamic shared memory: mbarriers, partial rows, squares, then the ring."""
    nbuf = stages + 1
    head = 16 * stages + 8 * nbuf + nbuf * cwarps * ROWS * 4 + cwarps * 4
    return -(-head // 128) * 128 + stages * stage_bytes(k)


def supported(n: int, k: int, cwarps: int, group_size: int, gate_out: bool = False) -> bool:
    """Groups of 128, 16-row tiles (gate-out: 8 gate + 8 up rows), K over the warps evenly."""
    rows_ok = n % (2 * 8) == 0 if gate_out else n % ROWS == 0
    return group_size == GROUP and rows_ok and k % (GROUP * cwarps) == 0


def consumer_warps(k: int) -> int | None:
    """The fewest consumer warps (of 8 and 16) that hold x in registers; None: too long a K."""
    for cw in (8, 16):
        if k % (GROUP * cw) == 0 and k // (GROUP * cw) <= MAX_GROUPS_A_WARP:
            return cw
    return None


def w4_gemv_bulk(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, bias: torch.Tensor | None = None, *,
                 rms_eps: float = 0.0, gate_out: bool = False, cwarps: int = 8,
                 stages: int = STAGES, grid: int | None = None, pdl: bool = True,
                 out: torch.Tensor | None = None, mode: int = 0, xq: int = 2) -> torch.Tensor:
    """x bf16 [K] or [1, K]; qweight uint8 [N, K/2]; scales fp16 / zeros uint8 [N, K/128];
    bias bf16 [N]. rms_eps > 0: the product of x / rms(x). gate_out: a [gate | up] weight,
    returns SiLU(gate) * up [.., N/2]. mode (probes only): 1 = the copies alone, 2 = the math
    alone (w4_bulk.cu's MODE). xq 2: x as two exact int8 halves a group on int8 tensor cores;
    0: bf16 pairs on bf16 ones (w4_bulk.cu's XQ)."""
    k = x.shape[-1]
    n = qweight.shape[0]
    if not supported(n, k, cwarps, k // scales.shape[1], gate_out):
        raise ValueError(f"w4_gemv_bulk: unsupported shape N={n} K={k} (groups of {GROUP}, "
                         f"N % {ROWS}, K % {GROUP * cwarps})")
    x = cuda_one_row_operands("w4_gemv_bulk", x, qweight, scales, zeros, bias, GROUP)
    smem = shared_bytes(k, cwarps, stages)
    defines = (("K", k), ("CWARPS", cwarps), ("STAGES", stages), ("MODE", mode), ("XQ", xq),
               ("BIAS", int(bias is not None)), ("RMS", int(rms_eps > 0)),
               ("GATE_OUT", int(gate_out)))
    kernel = compile_kernel("w4_bulk.cu", "w4_gemv_bulk", defines, x.device.index or 0, smem)
    n_out = n // 2 if gate_out else n
    if out is None:
        out = torch.empty(x.shape[:-1] + (n_out,), dtype=x.dtype, device=x.device)
    n_tiles = n // 2 // 8 if gate_out else n // ROWS
    blocks = grid or min(n_tiles, num_sms(x.device))
    kernel.launch(blocks, (cwarps + 1) * 32,
                  [x, qweight, scales, zeros, bias if bias is not None else out, out, n_tiles,
                   n // 2, float(rms_eps)], pdl)
    return out


def maybe_bulk(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor, group_size: int, bias: torch.Tensor | None,
               gate_out: bool = False, rms_eps: float = 0.0) -> torch.Tensor | None:
    """w4_gemv_bulk for int4_awq's one-row calls when SLIPSTREAM_W4_BULK=1 and the shape fits;
    else None (the caller's Triton path). Compiled on the first eager call: a shape first seen
    during a CUDA-graph capture stays on the Triton path."""
    k = x.shape[-1]
    if not (ENABLED and cuda_one_row_call(x, qweight, scales, zeros, bias)):
        return None
    cw = consumer_warps(k)
    if cw is None or not supported(qweight.shape[0], k, cw, group_size, gate_out):
        return None
    variant = (k, cw, bias is not None, rms_eps > 0, gate_out, x.device.index)
    if torch.cuda.is_current_stream_capturing() and variant not in _COMPILED:
        return None
    out = w4_gemv_bulk(x.reshape(1, k), qweight, scales, zeros, bias, rms_eps=rms_eps,
                       gate_out=gate_out, cwarps=cw)
    _COMPILED.add(variant)
    return out.reshape(x.shape[:-1] + out.shape[-1:])


_COMPILED: set[tuple] = set()  # maybe_bulk's variants compiled by an eager call


def split_int8_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (xq int32 [..., K], step float32 [..., K/128]): w4_bulk.cu's XQ numerics.
    Per group of 128, xq = round(x / step) with step = max|x| / 32512, so that xq splits exactly
    into int8 halves hi * 256 + lo, hi = (xq + 128) >> 8 (a 15-bit fixed point a group)."""
    g = x.float().unflatten(-1, (-1, GROUP))
    amax = g.abs().amax(-1)
    step = torch.where(amax > 0, amax / 32512.0, torch.ones_like(amax))
    inv = torch.where(amax > 0, 32512.0 / amax, torch.zeros_like(amax))
    # float32 product then round-half-even: the kernel's __float2int_rn(v * inv)
    xq = torch.round(g * inv[..., None]).to(torch.int32)
    return xq.flatten(-2), step


def w4_split_int8_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                            zeros: torch.Tensor) -> torch.Tensor:
    """The plain-torch twin of w4_gemv_bulk (XQ 1 and 2): per row n and group g,
    s[n,g] * step[g] * sum_k (q - z) xq, the sum exact in integers. Output in x's dtype."""
    from slipstream.quantization import utils as qu

    xq, step = split_int8_x(x)
    # float64 holds every integer here exactly (|sum| < 2^26), and unlike int64 it has a
    # matmul on CUDA
    q = qu.unpack_int4_rows(qweight).to(torch.float64)  # [N, K]
    n, k = q.shape
    xg = xq.to(torch.float64).unflatten(-1, (-1, GROUP))
    dots = torch.einsum("ngk,...gk->...ng", q.view(n, k // GROUP, GROUP), xg)
    exact = dots - zeros.to(torch.float64) * xg.sum(-1)[..., None, :]
    out = (scales.float() * step[..., None, :] * exact.float()).sum(-1)
    return out.to(x.dtype)
