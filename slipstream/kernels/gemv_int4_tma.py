"""One-row int4 GEMV whose weight words stream through shared memory by TMA (sm_90+).

Nsight Compute read the register-fed one-row kernels (gemv_int4) as load-latency bound: the
bytes a program keeps in flight live in its registers, so more of them means fewer resident
programs. Here a program's weight tiles are bulk-copied into a ring of STAGES shared-memory
buffers by the tensor-memory accelerator (Triton's pipelined descriptor loads), which costs no
registers and one instruction per tile, so each SM can keep ~100 KB requested. The products are
gemv_int4's chained packed-bf16 sums (_quartet_dot), the x pairs read in the words' layout.

A program owns BLOCK_N rows (GATE_OUT: BLOCK_N/2 gate rows and the matching up rows, two tiles
per step) and walks K in chunks of CW words (8 CW nibbles; each run of four words lies in one
group, so GROUP % 32 == 0). Rows past N read as zeros (the descriptor's padding) and are not
stored.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from slipstream.kernels import pdl
from slipstream.kernels.gemv_int4 import (
    _inv_rms,
    _quarters,
    _quartet_dot,
    _x_quarter,
    _x_squares,
)
from slipstream.kernels.pdl import pdl_release, pdl_wait

try:  # Triton >= 3.4 (host-built tensor-memory descriptors)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the tuner never offers these configs
    TensorDescriptor = None

CHUNK_WORDS = 32  # 128 bytes of a row per tile: one TMA box row, 256 weights (two groups of 128)


@triton.jit
def _ld_u8(ptrs, ASM: tl.constexpr):
    """uint8 loads as int32; ASM: by PTX, which Triton's pipeliner leaves alone (it would stage
    these few bytes through shared memory with a barrier a step)."""
    if ASM:
        return tl.inline_asm_elementwise("ld.global.nc.u8 $0, [$1];", "=r,l", [ptrs],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.load(ptrs).to(tl.int32)


@triton.jit
def _ld_f16(ptrs, ASM: tl.constexpr):
    """float16 loads (ASM: by PTX, as _ld_u8)."""
    if ASM:
        return tl.inline_asm_elementwise("ld.global.nc.b16 $0, [$1];", "=h,l", [ptrs],
                                         dtype=tl.float16, is_pure=True, pack=1)
    else:
        return tl.load(ptrs)


@triton.jit
def _x_quarter_nc(x_ptr, quad, AT: tl.constexpr, K, BF16X2: tl.constexpr):
    """_x_quarter without a mask (K is a whole number of chunks); on CUDA the two 64-bit loads
    are PTX (as _ld_u8) and one PRMT forms each pair."""
    word = (4 * quad + AT)[None, :]
    if BF16X2 == 2:
        xi = x_ptr.to(tl.pointer_type(tl.uint64)) + 2 * word
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 a, b, c, d;
            ld.global.nc.v2.b32 {a, b}, [$4];
            ld.global.nc.v2.b32 {c, d}, [$5];
            prmt.b32 $0, a, c, 0x5410;
            prmt.b32 $1, a, c, 0x7632;
            prmt.b32 $2, b, d, 0x5410;
            prmt.b32 $3, b, d, 0x7632;
            }""",
            constraints="=r,=r,=r,=r,l,l", args=[xi, xi + 1],
            dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        return _x_quarter(x_ptr, quad, AT, K, BF16X2)


@triton.jit
def _group_params(s_ptr, z_ptr, row0, kw, N, stride_sn, stride_zn, GROUP: tl.constexpr,
                  ROWS: tl.constexpr, CW: tl.constexpr, ASM: tl.constexpr):
    """(zeros, float32 scales) [ROWS, CW // 4] of the tile at rows row0.., word column kw: one
    group per run of four words."""
    rows = tl.minimum(row0 + tl.arange(0, ROWS), N - 1)
    g = ((kw // 4 + tl.arange(0, CW // 4)) * 32 // GROUP)[None, :]
    z8 = _ld_u8(z_ptr + rows[:, None] * stride_zn + g, ASM)
    s = _ld_f16(s_ptr + rows[:, None] * stride_sn + g, ASM).to(tl.float32)
    return z8, s


@triton.jit
def _chunk_x(x_ptr, kw, K, CW: tl.constexpr, BF16X2: tl.constexpr):
    """The 16 x-pair tensors [1, CW // 4] of the chunk at word column kw (_pair_quarters'
    order)."""
    quad = kw // 4 + tl.arange(0, CW // 4)
    x0 = _x_quarter_nc(x_ptr, quad, 0, K, BF16X2)
    x1 = _x_quarter_nc(x_ptr, quad, 1, K, BF16X2)
    x2 = _x_quarter_nc(x_ptr, quad, 2, K, BF16X2)
    x3 = _x_quarter_nc(x_ptr, quad, 3, K, BF16X2)
    return (x0[0], x0[1], x0[2], x0[3], x1[0], x1[1], x1[2], x1[3],
            x2[0], x2[1], x2[2], x2[3], x3[0], x3[1], x3[2], x3[3])


@triton.jit
def _tile_dot(w_desc, row0, kw, x, z8, s, ROWS: tl.constexpr, CW: tl.constexpr,
              BF16X2: tl.constexpr):
    """[ROWS, CW // 4]: sum_i (q_i - z) s x_i over each run of four words of rows row0.. at word
    column kw (the tile the descriptor brings in; x: _chunk_x, z8, s: _group_params of it)."""
    w = w_desc.load([row0, kw])
    w0, w1, w2, w3 = _quarters(tl.reshape(w, [ROWS, CW // 4, 2, 2]))
    return _quartet_dot(w0, w1, w2, w3, z8, x, BF16X2 == 2) * s


@triton.jit
def _w4_tma_kernel(x_ptr, w_desc, s_ptr, z_ptr, bias_ptr, out_ptr, N, K, stride_sn, stride_zn,
                   GROUP: tl.constexpr, BLOCK_N: tl.constexpr, CW: tl.constexpr,
                   STAGES: tl.constexpr, BF16X2: tl.constexpr, HAS_BIAS: tl.constexpr,
                   GATE_OUT: tl.constexpr = False, RMS_EPS: tl.constexpr = 0.0,
                   KP: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
                   FAKE: tl.constexpr = False):
    """out[n] = sum_k x_k w[n, k] (+ bias) for one row of x (GATE_OUT: SiLU(gate)·up, RMS_EPS:
    of x / rms(x), KP the power of two >= K for its statistic). The scales and zeros are read a
    step ahead in registers (the descriptor covers only the words: a tile's scale row is 4 bytes,
    under TMA's 16-byte minimum), and so is x: all programs walk K together, so each step's x
is an L2 read, whose latency would otherwise be paid every step."""
    pdl_release(USE_PDL)
    pid = tl.program_id(0)
    ASM: tl.constexpr = BF16X2 == 2
    ROWS: tl.constexpr = BLOCK_N // 2 if GATE_OUT else BLOCK_N
    row_a = pid * ROWS
    row_b = N // 2 + row_a  # GATE_OUT: the up rows of row_a's gate rows
    za, sa = _group_params(s_ptr, z_ptr, row_a, 0, N, stride_sn, stride_zn, GROUP, ROWS, CW, ASM)
    zb, sb = za, sa
    if GATE_OUT:
        zb, sb = _group_params(s_ptr, z_ptr, row_b, 0, N, stride_sn, stride_zn, GROUP, ROWS, CW,
                               ASM)
    pdl_wait(USE_PDL)
    x = _chunk_x(x_ptr, 0, K, CW, BF16X2)
    acc_a = tl.zeros([ROWS, CW // 4], tl.float32)
    acc_b = tl.zeros([ROWS, CW // 4], tl.float32)
    last = K // 8 - CW
    for kw in tl.range(0, K // 8, CW, num_stages=STAGES):
        nxt = tl.minimum(kw + CW, last)  # the last step re-reads its own (no branch)
        if FAKE:
            nxt = 0
        za_next, sa_next = _group_params(s_ptr, z_ptr, row_a, nxt, N, stride_sn, stride_zn,
                                         GROUP, ROWS, CW, ASM)
        x_next = _chunk_x(x_ptr, nxt, K, CW, BF16X2)
        acc_a += _tile_dot(w_desc, row_a, kw, x, za, sa, ROWS, CW, BF16X2)
        za, sa = za_next, sa_next
        if GATE_OUT:
            zb_next, sb_next = _group_params(s_ptr, z_ptr, row_b, nxt, N, stride_sn, stride_zn,
                                             GROUP, ROWS, CW, ASM)
            acc_b += _tile_dot(w_desc, row_b, kw, x, zb, sb, ROWS, CW, BF16X2)
            zb, sb = zb_next, sb_next
        x = x_next
    inv_rms = 1.0
    if RMS_EPS > 0:
        inv_rms = _inv_rms(_x_squares(x_ptr, K, KP), K, RMS_EPS)
    out_ty = out_ptr.dtype.element_ty
    offs = tl.arange(0, ROWS)
    a = tl.sum(acc_a, 1) * inv_rms
    if HAS_BIAS:
        a += tl.load(bias_ptr + tl.minimum(row_a + offs, N - 1)).to(tl.float32)
    if GATE_OUT:
        b = tl.sum(acc_b, 1) * inv_rms
        if HAS_BIAS:
            b += tl.load(bias_ptr + tl.minimum(row_b + offs, N - 1)).to(tl.float32)
        g = a.to(out_ty).to(tl.float32)  # each operand rounded first, as silu_and_mul sees them
        u = b.to(out_ty).to(tl.float32)
        tl.store(out_ptr + row_a + offs, (g * tl.sigmoid(g) * u).to(out_ty),
                 mask=row_a + offs < N // 2)
    else:
        tl.store(out_ptr + row_a + offs, a.to(out_ty), mask=row_a + offs < N)


def tma_ok(x2: torch.Tensor, k: int, group_size: int) -> bool:
    """Whether one bf16 row of x over K can run the TMA kernel: a Triton with host descriptors,
    sm_90+ (or the interpreter), K a whole number of chunks, groups of whole runs of four words,
    x 8-byte aligned (read as 64-bit pairs)."""
    if TensorDescriptor is None or x2.dtype != torch.bfloat16 or x2.data_ptr() % 8:
        return False
    if x2.is_cuda and torch.cuda.get_device_capability(x2.device)[0] < 9:
        return False
    return k % (8 * CHUNK_WORDS) == 0 and group_size % 32 == 0


def launch(x2: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
           bias: torch.Tensor | None, out: torch.Tensor, group_size: int, block_n: int,
           stages: int, num_warps: int, gate_out: bool = False, rms_eps: float = 0.0) -> None:
    """One launch over words int32 [N, K/8] (gemv_int4's layout; callers check tma_ok)."""
    n, k = words.shape[0], x2.shape[-1]
    rows = block_n // 2 if gate_out else block_n
    desc = TensorDescriptor.from_tensor(words, [rows, CHUNK_WORDS])
    grid = (triton.cdiv(n // 2 if gate_out else n, rows),)
    _w4_tma_kernel[grid](
        x2, desc, scales, zeros, bias if bias is not None else out, out, n, k, scales.stride(0),
        zeros.stride(0), GROUP=group_size, BLOCK_N=block_n, CW=CHUNK_WORDS, STAGES=stages,
        BF16X2=2 if x2.is_cuda else 1, HAS_BIAS=bias is not None, GATE_OUT=gate_out,
        RMS_EPS=float(rms_eps), KP=triton.next_power_of_2(k) if rms_eps else 0,
        num_warps=num_warps, FAKE=os.environ.get("FAKE") == "1", **pdl.launch_kwargs(x2.device))
