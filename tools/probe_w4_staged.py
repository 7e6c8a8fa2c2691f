"""Does staging the one-row int4 GEMV's tiles through shared memory (cp.async, Triton's
pipeliner) beat the production loop's two register buffers?

The production whole-K loop (gemv_int4._w4_whole_k_loop_kernel) holds a tile in flight in
registers while it computes the other: 168 registers at gate_up's n4 w2, ~48 KB an SM in
flight. Here the loop is `tl.range(num_stages=S)` over the program's tiles and the pipeliner
keeps S - 1 tiles in flight in shared memory, so registers hold only the tile being computed.
Scales and zeros are read as one int32 a group (scale bits << 16 | zero, packed here): 1-byte
zeros could not be copied asynchronously. Modes:
  staged: the products (gemv_int4's chained packed-bf16 sums), S stages
  loads:  the same loop with the products replaced by an XOR of the words (loads alone)
Graph-timed over weight copies past L2, beside the production launch of the tuner's config.

  python tools/probe_w4_staged.py --shapes gate_up,down,qkv,o --output-json F
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

# run as a script, this folder is on the path: the shared operands and reporting
from probe_w4_overlap import SHAPES, dump_rows, print_row, random_w4

from slipstream.kernels.gemv import int4 as gemv_int4
from slipstream.kernels.gemv.dense import num_sms, tile_rows
from slipstream.kernels.gemv.int4 import _whole_k_sums, _whole_k_x

PRODUCTION = {"gate_up": (4, 2, 6), "down": (2, 4, 2), "qkv": (8, 4, 2), "o": (8, 4, 2)}
GROUP = 128


@triton.jit
def _staged_tile(w_ptr, sz_ptr, rows, stride_wn, stride_szn, K: tl.constexpr, KP: tl.constexpr):
    """(words [rows, KP // 8], zeros, scales [rows, KP // 32]) from the packed scale/zero."""
    WP: tl.constexpr = KP // 8
    offs = tl.arange(0, WP)
    w = tl.load(w_ptr + (rows[:, None] * stride_wn + offs[None, :]), mask=(offs < K // 8)[None, :],
                other=0)
    RUNS: tl.constexpr = WP // 4
    BLOCK_N: tl.constexpr = rows.shape[0]
    flat = tl.arange(0, BLOCK_N * RUNS)
    run = flat % RUNS
    row = tl.reshape(tl.broadcast_to(rows[:, None], [BLOCK_N, RUNS]), [BLOCK_N * RUNS])
    sz = tl.load(sz_ptr + (row * stride_szn + run * 32 // 128), mask=run < K // 32, other=0)
    sz = tl.reshape(sz, [BLOCK_N, RUNS])
    z8 = (sz & 0xFF).to(tl.uint8)
    s = (sz >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return w, z8, s


@triton.jit
def _staged_kernel(x_ptr, w_ptr, sz_ptr, out_ptr, N, n_tiles, stride_wn, stride_szn,
                   BLOCK_N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                   STAGES: tl.constexpr, LOADS_ONLY: tl.constexpr, ASM: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    n_it = tl.cdiv(n_tiles - pid, step)
    x = _whole_k_x(x_ptr, K, KP, 2 if ASM else 1)
    for it in tl.range(0, n_it, num_stages=STAGES):
        tile = pid + it * step
        rows = tile_rows(tile, N, BLOCK_N, False)
        w, z8, s = _staged_tile(w_ptr, sz_ptr, rows, stride_wn, stride_szn, K, KP)
        if LOADS_ONLY:
            sums = tl.sum(w, 1).to(tl.float32) + tl.sum(z8.to(tl.float32) + s.to(tl.float32), 1)
        else:
            sums = _whole_k_sums(w, z8, s, x, 128, BLOCK_N, KP, ASM)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + offs_n, sums.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def pack_scale_zero(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """int32 [N, K/128]: the float16 scale's bits above the zero point."""
    return (scales.view(torch.int16).to(torch.int32) << 16) | zeros.to(torch.int32)


def launch(x, words, sz, out, block_n: int, warps: int, persist: int, stages: int,
           loads_only: bool) -> None:
    n, k = words.shape[0], x.shape[-1]
    n_tiles = triton.cdiv(n, block_n)
    _staged_kernel[(min(n_tiles, persist * num_sms(x.device)),)](
        x, words, sz, out, n, n_tiles, words.stride(0), sz.stride(0), BLOCK_N=block_n, K=k,
        KP=triton.next_power_of_2(k), STAGES=stages, LOADS_ONLY=loads_only, ASM=x.is_cuda,
        num_warps=warps)


def _production(x, words, scales, zeros, spec: tuple[int, int, int]) -> tuple[float, torch.Tensor]:
    """(us, output) of gemv_int4's whole-K loop launch at (rows, warps, programs an SM)."""
    from slipstream.kernels.runtime.tuning import graph_time_us, weight_copies
    bn, wp, pp = spec
    cfg = gemv_int4.W4Config(block_n=bn, block_k=128, split_k=1, num_warps=wp, prefetch=True,
                             bit_convert=2, whole_k=True, persist=pp)
    us = graph_time_us(lambda a: gemv_int4.w4_gemv(x, a[0].view(torch.uint8), a[1], a[2], GROUP,
                                                   None, cfg),
                       weight_copies((words, scales, zeros)))
    return us, gemv_int4.w4_gemv(x, words.view(torch.uint8), scales, zeros, GROUP, None, cfg)


def _staged_row(x, words, sz, ref, spec: tuple[int, int, int], stages: int) -> dict:
    """us of the staged loop (products, loads alone) at one config, and its max error."""
    from slipstream.kernels.runtime.tuning import graph_time_us, weight_copies
    bn, wp, pp = spec
    out = torch.empty(1, words.shape[0], device="cuda", dtype=torch.bfloat16)
    copies = weight_copies((words, sz))
    row = dict(block_n=bn, warps=wp, persist=pp, stages=stages)
    try:
        for mode, lo in (("staged", False), ("loads", True)):
            row[mode] = graph_time_us(
                lambda a, lo=lo: launch(x, a[0], a[1], out, bn, wp, pp, stages, lo), copies)
        launch(x, words, sz, out, bn, wp, pp, stages, False)
        row["max_err"] = float((out.float() - ref.float()).abs().max())
    except Exception as exc:  # report and go on
        row["error"] = str(exc)[:160]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-json", default="")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--configs", default="4:2:4,4:2:8,8:4:2,8:4:4,4:4:4,2:2:8",
                    help="rows:warps:programs an SM")
    ap.add_argument("--stages", default="2,3,4")
    ns = ap.parse_args()
    rows = []
    for name in ns.shapes.split(","):
        x, words, scales, zeros = random_w4(*SHAPES[name])
        prod, ref = _production(x, words, scales, zeros, PRODUCTION[name])
        print(f"{name}: production {PRODUCTION[name]} {prod:.2f} us", flush=True)
        sz = pack_scale_zero(scales, zeros)
        for spec in ns.configs.split(","):
            for stages in (int(v) for v in ns.stages.split(",")):
                row = dict(shape=name, production=prod,
                           **_staged_row(x, words, sz, ref, tuple(int(v) for v in spec.split(":")),
                                         stages))
                print_row(row)
                rows.append(row)
    dump_rows(ns.output_json, rows)


if __name__ == "__main__":
    main()
