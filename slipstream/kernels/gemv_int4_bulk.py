"""One-row int4_awq GEMV in CUDA C++ (w4_bulk.cu): a producer warp streams 16-row tiles into a
shared-memory ring with bulk asynchronous copies, consumer warps sum on the tensor cores. An
experiment against the Triton one-row kernels (benchmarks/probe_w4_bulk.py); CUDA only, groups
of 128, K a multiple of 128 x the consumer warps."""
from __future__ import annotations

import torch

from slipstream.kernels.cuda_launch import compile_kernel
from slipstream.kernels.gemv import num_sms
from slipstream.kernels.int4_common import packed_words

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
    packed_words(qweight, scales, zeros, GROUP, k)  # the layout's shape and dtype checks
    if not (qweight.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous()):
        raise ValueError("w4_gemv_bulk: qweight, scales and zeros must be contiguous (bulk copies)")
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.contiguous().clone()  # 128-bit loads of x
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
    q = qu.unpack_int4_rows(qweight).to(torch.int64)  # [N, K]
    n, k = q.shape
    dots = torch.einsum("ngk,...gk->...ng", q.view(n, k // GROUP, GROUP),
                        xq.to(torch.int64).unflatten(-1, (-1, GROUP)))
    qsum = xq.to(torch.int64).unflatten(-1, (-1, GROUP)).sum(-1)  # [..., G]
    exact = dots - zeros.to(torch.int64) * qsum[..., None, :]
    out = (scales.float() * step[..., None, :] * exact.float()).sum(-1)
    return out.to(x.dtype)
