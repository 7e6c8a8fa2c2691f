"""Where the one-row int4 GEMV's time goes: its whole-K tile loop (gemv_int4's
_w4_whole_k_loop_kernel, built here from the same helpers) in three modes, graph-timed over weight
copies past L2, beside the production launch of the same config.

- `loop`: one tile requested ahead of the products through one rotating buffer (the production
  loop before session 28, whose requests ptxas issues after the products).
- `compute`: the products alone. The first tile is loaded once; every step takes the products
  of its words XORed with the tile index (one instruction a word, so the compiler cannot hoist
  them). This gives the compute time C with no weight traffic.
- `ahead2`: two tiles requested ahead of the products instead of one.
- `production`: gemv_int4's own launch of the config (two buffers turned so that each refill
  is in flight during the other buffer's products; session 27-28 fenced the rotating loop's
  products behind a barrier instead, `early`: Nsight Compute 29.7 -> 22.9 us on gate_up).
- gate_up also `gate_out`, `rms` and `gate_out_rms`: the production launch as W1 calls it (the
  tuner read the gate-out + norm call ~2 us over the plain product in session 29: 20.5 / 18.5).

probe_w4_loads.py gave the loads alone (session 27: gate_up 16.4-17.0 us, down 9.2, qkv 5.2
against the GEMV's ~21-22, ~14.8 and ~7.0). If `compute` is well under `loop` while `loop` is well
over the loads alone, the two are not overlapping: deeper requests (`ahead2`) should help. If
`compute` is close to `loop`, the products bound the GEMV.

  python tools/probe_w4_overlap.py --output-json $OUT/w4_overlap.json
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from slipstream.kernels.gemv import int4 as gemv_int4
from slipstream.kernels.gemv.dense import num_sms, tile_rows
from slipstream.kernels.gemv.int4 import _whole_k_sums, _whole_k_tile, _whole_k_x
from slipstream.kernels.runtime.tuning import graph_time_us, weight_copies

SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336), "qkv": (6144, 4096),
          "o": (4096, 4096)}  # (N, K)
CONFIGS = {"gate_up": [(4, 2, 4), (8, 4, 2), (4, 2, 6), (4, 2, 8)],
           "down": [(2, 4, 2)],
           "qkv": [(8, 4, 2), (4, 2, 4)], "o": [(8, 4, 2), (4, 2, 4)]}  # (rows, warps, per SM)
MODES = {"loop": 0, "compute": 1, "ahead2": 2}
GROUP = 128


@triton.jit
def _overlap_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, N, n_tiles, stride_wn, stride_sn,
                    stride_zn, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, K: tl.constexpr,
                    KP: tl.constexpr, MODE: tl.constexpr, ASM: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    rows = tile_rows(pid, N, BLOCK_N, False)
    w, z8, s = _whole_k_tile(w_ptr, s_ptr, z_ptr, rows, stride_wn, stride_sn, stride_zn, GROUP,
                             K, KP)
    if MODE == 2:
        rows1 = tile_rows(tl.minimum(pid + step, n_tiles - 1), N, BLOCK_N, False)
        w1, z1, s1 = _whole_k_tile(w_ptr, s_ptr, z_ptr, rows1, stride_wn, stride_sn, stride_zn,
                                   GROUP, K, KP)
    x = _whole_k_x(x_ptr, K, KP, 2 if ASM else 1)
    for tile in range(pid, n_tiles, step):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if MODE == 1:
            sums = _whole_k_sums(w ^ tile, z8, s, x, GROUP, BLOCK_N, KP, ASM)
        elif MODE == 2:
            rows2 = tile_rows(tl.minimum(tile + 2 * step, n_tiles - 1), N, BLOCK_N, False)
            w2, z2, s2 = _whole_k_tile(w_ptr, s_ptr, z_ptr, rows2, stride_wn, stride_sn,
                                       stride_zn, GROUP, K, KP)
            sums = _whole_k_sums(w, z8, s, x, GROUP, BLOCK_N, KP, ASM)
            w, z8, s, w1, z1, s1 = w1, z1, s1, w2, z2, s2
        else:
            next_rows = tile_rows(tl.minimum(tile + step, n_tiles - 1), N, BLOCK_N, False)
            nw, nz, ns = _whole_k_tile(w_ptr, s_ptr, z_ptr, next_rows, stride_wn, stride_sn,
                                       stride_zn, GROUP, K, KP)
            sums = _whole_k_sums(w, z8, s, x, GROUP, BLOCK_N, KP, ASM)
            w, z8, s = nw, nz, ns
        tl.store(out_ptr + offs_n, sums.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def launch(x, words, scales, zeros, out, block_n: int, warps: int, persist: int, mode: int):
    n, k = words.shape[0], x.shape[-1]
    n_tiles = triton.cdiv(n, block_n)
    _overlap_kernel[(min(n_tiles, persist * num_sms(x.device)),)](
        x, words, scales, zeros, out, n, n_tiles, words.stride(0), scales.stride(0),
        zeros.stride(0), GROUP=GROUP, BLOCK_N=block_n, K=k, KP=triton.next_power_of_2(k),
        MODE=mode, ASM=x.is_cuda, num_warps=warps)


def production_config(block_n: int, warps: int, persist: int):
    """gemv_int4's whole-K loop candidate with these rows, warps and programs an SM."""
    return gemv_int4.W4Config(block_n=block_n, block_k=128, split_k=1, num_warps=warps,
                              prefetch=True, bit_convert=2, whole_k=True, persist=persist)


def measure(x, words, scales, zeros, block_n: int, warps: int, persist: int,
            gate_kinds: bool = False) -> dict:
    """us of the production launch and of each mode for one config; the loop's max error
    against the production output (they should agree). gate_kinds: the production launch also
    as a gate-out, with the in-GEMV norm, and both."""
    out = torch.empty(1, words.shape[0], device="cuda", dtype=torch.bfloat16)
    copies = weight_copies((words, scales, zeros))
    cfg = production_config(block_n, warps, persist)
    row = dict(block_n=block_n, warps=warps, persist=persist)
    row["production"] = graph_time_us(
        lambda a: gemv_int4.w4_gemv(x, a[0].view(torch.uint8), a[1], a[2], GROUP, None, cfg),
        copies)
    if gate_kinds:  # the call kinds W1 runs at gate_up: what the gate-out and the norm cost
        for kind, eps in [("gate_out", 0.0), ("gate_out_rms", 1e-5)]:
            row[kind] = graph_time_us(lambda a, e=eps: gemv_int4.w4_gemv_gate_out(
                x, a[0].view(torch.uint8), a[1], a[2], GROUP, None, cfg, rms_eps=e), copies)
        row["rms"] = graph_time_us(lambda a: gemv_int4.w4_gemv(
            x, a[0].view(torch.uint8), a[1], a[2], GROUP, None, cfg, rms_eps=1e-5), copies)
    for mode_name, mode in MODES.items():
        try:
            row[mode_name] = graph_time_us(
                lambda a, mode=mode: launch(x, *a, out, block_n, warps, persist, mode), copies)
        except Exception as exc:  # report and go on
            print(f"n{block_n} w{warps} {persist}/SM {mode_name}: {exc}"[:200])
    launch(x, words, scales, zeros, out, block_n, warps, persist, MODES["loop"])
    ref = gemv_int4.w4_gemv(x, words.view(torch.uint8), scales, zeros, GROUP, None, cfg)
    row["loop_max_err"] = float((out.float() - ref.float()).abs().max())
    return row


def random_w4(n: int, k: int) -> tuple[torch.Tensor, ...]:
    """(x [1, K] bf16, words int32 [N, K/8], scales float16 and zeros uint8 [N, K/128]):
    random operands of one int4 GEMV on the GPU."""
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    words = torch.randint(-2**31, 2**31, (n, k // 8), device="cuda", dtype=torch.int32)
    scales = (torch.rand(n, k // GROUP, device="cuda") * 0.01).half()
    zeros = torch.randint(0, 16, (n, k // GROUP), device="cuda", dtype=torch.uint8)
    return x, words, scales, zeros


def print_row(row: dict) -> None:
    print(" ".join(f"{key}={val:.2f}" if isinstance(val, float) else f"{key}={val}"
                   for key, val in row.items()), flush=True)


def dump_rows(path: str, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-json", default="")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ns = ap.parse_args()
    rows = []
    for name in ns.shapes.split(","):
        x, words, scales, zeros = random_w4(*SHAPES[name])
        nbytes = words.numel() * 4 + scales.numel() * 2 + zeros.numel()
        for block_n, warps, persist in CONFIGS[name]:
            row = dict(shape=name, **measure(x, words, scales, zeros, block_n, warps, persist,
                                             gate_kinds=name == "gate_up"))
            row["gbps_loop"] = nbytes / row.get("loop", float("nan")) / 1e3
            print_row(row)
            rows.append(row)
    dump_rows(ns.output_json, rows)


if __name__ == "__main__":
    main()
