"""What a kernel boundary costs in a batch-1 decode chain, and whether a flag wait beats PDL's.

A chain of N kernels is captured in one CUDA graph, as a decode step is. Kernel i streams its own
`--mb` MB buffer (weights: read before any wait) and then reads the one value kernel i-1 wrote.
The wait between them is one of:
  plain: no PDL (the next launch starts after the previous grid has drained)
  pdl:   PDL launch, griddepcontrol.launch_dependents at the top, griddepcontrol.wait before the
         dependent read (the engine's scheme, kernels/runtime/pdl.py)
  flag:  PDL launch and trigger as above, but the dependent read waits for a counter that each
         program of kernel i-1 bumps (release) after its store: it waits for the data, not for
         the grid's completion (polled with atomic adds of 0)
  flag_ld: the same counter polled with ld.acquire and a short nanosleep
Per kernel us = graph time / N; against the copy floor of `--mb` at `--tbps`.

    python tools/probe_sync_chain.py --mb 0,8,30 --programs 528 --kernels 160
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from slipstream.kernels.runtime.pdl import pdl_release, pdl_wait


@triton.jit
def _ld_acquire(ptr):
    """ld.acquire.gpu of one int32, then a short nanosleep: a poll that is a plain L2 read, not an
    atomic, and that leaves the issue slots to the producer while it waits."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1]; nanosleep.u32 64;",
                                     "=r,l", [ptr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _chain_kernel(w_ptr, words_per_prog, x_ptr, cnt_ptr, i, prev_programs,
                  MODE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if MODE != 0:
        pdl_release(True)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    base = w_ptr + pid.to(tl.int64) * words_per_prog
    for k in range(0, words_per_prog, BLOCK):
        acc += tl.load(base + k + offs)
    if MODE == 1:
        pdl_wait(True)
    if MODE == 2:
        seen = tl.atomic_add(cnt_ptr + i - 1, 0, sem="acquire", scope="gpu")
        while seen < prev_programs:
            seen = tl.atomic_add(cnt_ptr + i - 1, 0, sem="acquire", scope="gpu")
    if MODE == 3:
        seen = _ld_acquire(cnt_ptr + i - 1)
        while seen < prev_programs:
            seen = _ld_acquire(cnt_ptr + i - 1)
    prev = tl.load(x_ptr + i - 1)
    if pid == 0:
        tl.store(x_ptr + i, prev + tl.where(tl.sum(acc, 0) == -7, 1, 0))
    if MODE >= 2:
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr + i, 1, sem="release", scope="gpu")


MODES = {"plain": 0, "pdl": 1, "flag": 2, "flag_ld": 3}


def _run(mode: str, mb: float, programs: int, kernels: int, warps: int) -> dict:
    block = 1024
    words_per_prog = max(block, int(mb * 2**20 / 4 / programs) // block * block) if mb else 0
    bufs = [torch.ones(programs * max(words_per_prog, 1), dtype=torch.int32, device="cuda")
            for _ in range(kernels)]
    x = torch.zeros(kernels + 1, dtype=torch.int32, device="cuda")
    cnt = torch.zeros(kernels + 1, dtype=torch.int32, device="cuda")
    extra = {} if mode == "plain" else {"launch_pdl": True}

    def step():
        cnt.zero_()
        cnt[0:1].fill_(programs)
        x[0:1].add_(1)  # a stale read anywhere in the chain leaves x[N] behind x[0]
        for i in range(1, kernels + 1):
            _chain_kernel[(programs,)](bufs[i - 1], words_per_prog, x, cnt, i, programs,
                                       MODE=MODES[mode], BLOCK=block, num_warps=warps, **extra)

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1000 / reps / kernels
    ok = int(x[kernels].item()) == int(x[0].item())
    real_mb = programs * words_per_prog * 4 / 2**20
    return {"mode": mode, "mb": round(real_mb, 2), "programs": programs, "us_per_kernel": round(us, 3),
            "chain_ok": ok}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", default="0,8,30")
    ap.add_argument("--programs", default="132,528")
    ap.add_argument("--kernels", type=int, default=160)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--tbps", type=float, default=4.3)
    ap.add_argument("--output-json")
    args = ap.parse_args()
    rows = []
    for mb in (float(v) for v in args.mb.split(",")):
        for programs in (int(v) for v in args.programs.split(",")):
            for mode in MODES:
                rows.append(_run(mode, mb, programs, args.kernels, args.warps))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(rows, indent=1))
    print(f"{'MiB':>6} {'progs':>6} {'floor us':>9} " + " ".join(f"{m:>8}" for m in MODES))
    for i in range(0, len(rows), len(MODES)):
        r = rows[i]
        floor = r["mb"] * 2**20 / (args.tbps * 1e12) * 1e6
        print(f"{r['mb']:>6} {r['programs']:>6} {floor:>9.2f} "
              + " ".join(f"{rows[i + j]['us_per_kernel']:>8.2f}" for j in range(len(MODES)))
              + ("" if all(rows[i + j]["chain_ok"] for j in range(len(MODES))) else "  CHAIN WRONG"))


if __name__ == "__main__":
    main()
