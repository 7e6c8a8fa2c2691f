"""One-row int4_awq GEMV in CUDA C++ (w4_bulk.cu): a producer warp streams 16-row tiles into a
shared-memory ring with bulk asynchronous copies, consumer warps sum on the tensor cores. An
experiment against the Triton one-row kernels (benchmarks/probe_w4_bulk.py); CUDA only, groups
of 128, K a multiple of 128 x the consumer warps."""
from __future__ import annotations

import torch

from slipstream.kernels.cuda_launch import compile_kernel
from slipstream.kernels.gemv import num_sms

ROWS = 16
GROUP = 128


def stage_bytes(k: int) -> int:
    """One ring stage: 16 padded weight rows, their fp16 scales and uint8 zeros (w4_bulk.cu)."""
    ng = k // GROUP
    raw = ROWS * (k // 2 + 64) + ROWS * ng * 2 + ROWS * ng
    return -(-raw // 128) * 128


def shared_bytes(k: int, cwarps: int, stages: int) -> int:
    nbuf = stages + 1
    head = -(-(2 * stages * 8 + nbuf * 8 + nbuf * cwarps * ROWS * 4) // 128) * 128
    return head + stages * stage_bytes(k)


def supported(n: int, k: int, cwarps: int, group_size: int) -> bool:
    return group_size == GROUP and n % ROWS == 0 and k % (GROUP * cwarps) == 0


def w4_gemv_bulk(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor, *, cwarps: int = 8, stages: int = 5,
                 grid: int | None = None, pdl: bool = True,
                 out: torch.Tensor | None = None, mode: int = 0,
                 xq: int = 2) -> torch.Tensor:
    """x bf16 [K] or [1, K]; qweight uint8 [N, K/2]; scales fp16 / zeros uint8 [N, K/128].
    mode (probes only): 1 = the copies alone, 2 = the math alone (w4_bulk.cu's MODE). xq: x as
    two exact int8 halves a group on int8 tensor cores (2: odd nibbles unshifted, 1: shifted),
    0: bf16 pairs on bf16 ones (w4_bulk.cu's XQ)."""
    k = x.shape[-1]
    n = qweight.shape[0]
    if not supported(n, k, cwarps, k // scales.shape[1]):
        raise ValueError(f"w4_gemv_bulk: unsupported shape N={n} K={k} (groups of {GROUP}, "
                         f"N % {ROWS}, K % {GROUP * cwarps})")
    smem = shared_bytes(k, cwarps, stages)
    kernel = compile_kernel("w4_bulk.cu", "w4_gemv_bulk",
                            (("K", k), ("CWARPS", cwarps), ("STAGES", stages), ("MODE", mode),
                             ("XQ", xq)),
                            x.device.index or 0, smem)
    if out is None:
        out = torch.empty(x.shape[:-1] + (n,), dtype=x.dtype, device=x.device)
    n_tiles = n // ROWS
    blocks = grid or min(n_tiles, num_sms(x.device))
    kernel.launch(blocks, (cwarps + 1) * 32, [x, qweight, scales, zeros, out, n_tiles], pdl)
    return out
