"""The device side of the L2 prefetch (kernels/attention/l2_spans.py explains it and builds the
span tables): each thread of a program issues one `cp.async.bulk.prefetch.L2` for its piece of a
span. A hint with no result, so no reference twin; RECORD mode lets the interpreter check coverage.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from slipstream.kernels.attention.l2_spans import chunk_bytes

# PTX: thread t prefetches bytes [t * chunk, (t + 1) * chunk) of the span ($1 address, $2 bytes,
# $3 chunk), clipped to its end; threads past the end issue nothing.
_SPAN_ASM = tl.constexpr("""{
        .reg .u32 t, sz;
        .reg .u64 off, rem, a;
        .reg .pred p;
        mov.u32 t, %tid.x;
        mul.wide.u32 off, t, $3;
        setp.lt.u64 p, off, $2;
        sub.u64 rem, $2, off;
        cvt.u64.u32 a, $3;
        min.u64 rem, rem, a;
        cvt.u32.u64 sz, rem;
        add.u64 a, $1, off;
        @p cp.async.bulk.prefetch.L2.global [a], sz;
        mov.u32 $0, 0;
        }""")


@triton.jit
def _bulk_prefetch_span(addr, nbytes, chunk):
    """Each thread of the program prefetches its `chunk` bytes of [addr, addr + nbytes)."""
    return tl.inline_asm_elementwise(_SPAN_ASM, "=r,l,l,r", [addr, nbytes, chunk],
                                     dtype=tl.int32, is_pure=False, pack=1)


# prefetch_spans' MODE: what a program does with each span it is given.
OFF, PREFETCH, RECORD = 0, 1, 2
RECORD_MARK = 1 << 40  # RECORD adds this to a span's byte count (beyond any real span)
_MARK = tl.constexpr(RECORD_MARK)


@triton.jit
def prefetch_spans(table_ptr, n_spans, program, num_programs, chunk, MODE: tl.constexpr):
    """Spans program, program + num_programs, ... of the table, each split over the program's
    threads in `chunk`-byte pieces (chunk * threads >= SPAN_BYTES). MODE: PREFETCH; OFF
    compiles to nothing (the interpreter has no inline PTX); RECORD (tests, the interpreter)
    adds RECORD_MARK to each given span's byte count instead, so a test can check that the
    programs took every span exactly once."""
    if MODE == 1:
        for i in range(program, n_spans, num_programs):
            addr = tl.load(table_ptr + 2 * i)
            nbytes = tl.load(table_ptr + 2 * i + 1)
            _bulk_prefetch_span(addr, nbytes, chunk)
    elif MODE == 2:
        for i in range(program, n_spans, num_programs):
            tl.atomic_add(table_ptr + 2 * i + 1, _MARK)


@triton.jit
def _prefetch_kernel(table_ptr, n_spans, chunk, MODE: tl.constexpr):
    prefetch_spans(table_ptr, n_spans, tl.program_id(0), tl.num_programs(0), chunk, MODE)


def prefetch(table: torch.Tensor, programs: int = 132, num_warps: int = 4) -> None:
    """Prefetch a span table's bytes into L2 by a launch of its own (benchmarks and tests; the
    decode step does it inside the attention launch). No-op off CUDA."""
    if not table.is_cuda or table.numel() == 0:
        return
    _prefetch_kernel[(min(programs, table.shape[0]),)](
        table, table.shape[0], chunk_bytes(num_warps), MODE=PREFETCH, num_warps=num_warps)
