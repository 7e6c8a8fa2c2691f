"""How fast the one-row int4 GEMV's memory structure alone can go: a twin of the whole-K tile loop
(gemv_int4._w4_whole_k_loop_kernel: a program's tile of rows x all of K requested, then the next
tile requested before this one is used, at most `persist` programs an SM) that only adds the
words, scales and zeros up (one integer add a word: ~1/8 of an instruction a weight) instead of
computing the products. Its output is a checksum, not a product: timing only.

Session 25 found the int4 GEMVs barely faster with their weights in L2, session 26 a kernel with
a third fewer instructions a weight no faster: if this twin reaches the copy bandwidth at the
tuner's tile shapes, the products (their dependency chains) are what holds the GEMV back; if it
stops near the GEMV's own ~2.9 TB/s (gate_up), the load structure is.

  python tools/probe_w4_loads.py --output-json $OUT/w4_loads.json
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from slipstream.kernels.gemv.dense import num_sms
from slipstream.kernels.runtime.tuning import graph_time_us, weight_copies

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096)}  # (N, K)
# (rows a tile, warps, programs an SM): the tuner's W1 choices first, then neighbours.
TILES = [(4, 2, 4), (8, 4, 2), (2, 4, 2), (4, 2, 6), (4, 2, 8), (8, 4, 4), (16, 4, 2),
         (2, 2, 8), (4, 4, 4)]


@triton.jit
def _tile(w_ptr, s_ptr, z_ptr, tile, BLOCK_N: tl.constexpr, WORDS: tl.constexpr,
          GROUPS: tl.constexpr, WP: tl.constexpr, GP: tl.constexpr):
    """A tile's words [BLOCK_N, WP: WORDS rounded up to a power of two], scales and zeros
    (GP: GROUPS rounded up; as the GEMV's _whole_k_tile, 0 past K)."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, WP)
    w = tl.load(w_ptr + rows[:, None] * WORDS + offs_w[None, :], mask=offs_w[None, :] < WORDS,
                other=0)
    offs_g = tl.arange(0, GP)
    g = rows[:, None] * GROUPS + offs_g[None, :]
    ok = offs_g[None, :] < GROUPS
    return w, tl.load(s_ptr + g, mask=ok, other=0.0), tl.load(z_ptr + g, mask=ok, other=0)


@triton.jit
def _loads_only_kernel(w_ptr, s_ptr, z_ptr, out_ptr, n_tiles, BLOCK_N: tl.constexpr,
                       WORDS: tl.constexpr, GROUPS: tl.constexpr, WP: tl.constexpr,
                       GP: tl.constexpr):
    """out[rows] = a checksum of each row's words, scales and zeros, tile by tile as the
    whole-K loop walks them."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    w, s, z = _tile(w_ptr, s_ptr, z_ptr, pid, BLOCK_N, WORDS, GROUPS, WP, GP)
    for tile in range(pid, n_tiles, step):
        nw, ns, nz = _tile(w_ptr, s_ptr, z_ptr, tl.minimum(tile + step, n_tiles - 1), BLOCK_N,
                           WORDS, GROUPS, WP, GP)
        total = (tl.sum(w, 1) + tl.sum(s.to(tl.int16, bitcast=True).to(tl.int32), 1)
                 + tl.sum(z.to(tl.int32), 1))
        tl.store(out_ptr + tile * BLOCK_N + tl.arange(0, BLOCK_N), total)
        w, s, z = nw, ns, nz


def launch(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, out: torch.Tensor,
           block_n: int, warps: int, persist: int) -> None:
    n, k = words.shape[0], words.shape[1] * 8
    n_tiles = n // block_n
    _loads_only_kernel[(min(n_tiles, persist * num_sms(words.device)),)](
        words, scales, zeros, out, n_tiles, BLOCK_N=block_n, WORDS=k // 8, GROUPS=k // 128,
        WP=triton.next_power_of_2(k // 8), GP=triton.next_power_of_2(k // 128), num_warps=warps)


def run(n: int, k: int, block_n: int, warps: int, persist: int):
    """(us, GB/s) of the twin over an [n, k] int4_awq weight (random bits)."""
    words = torch.randint(-2**31, 2**31, (n, k // 8), device="cuda", dtype=torch.int32)
    scales = torch.randn(n, k // 128, device="cuda").half()
    zeros = torch.randint(0, 16, (n, k // 128), device="cuda", dtype=torch.uint8)
    out = torch.empty(n, device="cuda", dtype=torch.int32)
    us = graph_time_us(lambda a: launch(*a, out, block_n, warps, persist),
                       weight_copies((words, scales, zeros)))
    nbytes = words.numel() * 4 + scales.numel() * 2 + zeros.numel()
    return us, nbytes / us / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-json", default="")
    ns = ap.parse_args()
    rows = []
    for name, (n, k) in SHAPES.items():
        for block_n, warps, persist in TILES:
            if k == 14336 and block_n * 2048 // (32 * warps) > 64:  # K rounded up: registers
                continue
            try:
                us, gbs = run(n, k, block_n, warps, persist)
            except Exception as exc:  # a tile that does not fit: report and go on
                print(f"{name} n{block_n} w{warps} {persist}/SM: failed {exc}"[:160])
                continue
            print(f"{name:8} n{block_n:<3} w{warps} {persist}/SM {us:7.1f} us {gbs:6.0f} GB/s",
                  flush=True)
            rows.append(dict(shape=name, block_n=block_n, warps=warps, persist=persist, us=us,
                             gbps=gbs))
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
