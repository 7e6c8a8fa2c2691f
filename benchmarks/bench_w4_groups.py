"""int4_awq at every group size on SmolLM2-135M's layer shapes (hidden 576 = 4.5 x 128: a short
last group at 128), against bf16 F.linear, on one GPU.

For each (N, K), group size (32, 64, 128, per channel) and M: int4_linear (the engine's measured
choice: the CUDA C++ one-row kernel where it takes the shape, the Triton GEMVs, the W4A16 GEMM or
dequantize + cuBLAS) and bf16 cuBLAS, graph-timed over L2-sized weight copies; the max error
against the float64 reference. `--zeros int,float` times each shape with its integer zero points
and again with the same weights' float zeros (zero x scale in fp16, the form GGUF Q4_1 loads
as): the cost of the float form. Prints a table; `--output-json` keeps it.

  python benchmarks/bench_w4_groups.py [--ms 1,16,256] [--groups 32,64,128,0] [--zeros int,float]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from slipstream.kernels.gemv import int4 as gemv_int4
from slipstream.kernels.runtime.tuning import graph_time_us, weight_copies
from slipstream.quantization import utils as qu

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def time_us(fn, args: tuple[torch.Tensor, ...]) -> float:
    return graph_time_us(lambda a: fn(*a), weight_copies(args))


def measure(name: str, n: int, k: int, group: int, m: int, zeros: str = "int") -> dict:
    g = group or k
    w = torch.randn(n, k, device="cuda") * 0.05
    q, s, z = qu.quantize_int4_groupwise(w, g)
    s = s.half()
    if zeros == "float":  # the same weights, z s rounded to fp16
        z = (z.float() * s.float()).half()
    packed = (qu.pack_int4_rows(q), s, z)
    x = torch.randn(m, k, device="cuda").bfloat16()
    want = gemv_int4.w4_linear_reference(x.double(), *packed, g)
    got = gemv_int4.int4_linear(x, *packed, g)  # measures and keeps its choice first
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    int4_us = time_us(lambda x_, q_, s_, z_: gemv_int4.int4_linear(x_, q_, s_, z_, g), (x, *packed))
    wb = w.bfloat16()
    bf16_us = time_us(lambda x_, w_: F.linear(x_, w_), (x, wb))
    return {
        "layer": name,
        "n": n,
        "k": k,
        "group": group or "channel",
        "zeros": zeros,
        "m": m,
        "int4_us": round(int4_us, 2),
        "bf16_us": round(bf16_us, 2),
        "speedup": round(bf16_us / int4_us, 2),
        "max_err": err,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,16,256")
    ap.add_argument("--groups", default="32,64,128,0", help="0: per channel")
    ap.add_argument("--zeros", default="int", help="int, float or both (int,float)")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    rows = []
    print(
        f"{'layer':>8} {'N':>5} {'K':>5} {'group':>7} {'zeros':>5} {'M':>5} {'int4 us':>8} {'bf16 us':>8} "
        f"{'x bf16':>7} {'max err':>8}"
    )
    for name, (n, k) in SHAPES.items():
        for group in (int(v) for v in args.groups.split(",")):
            for m in (int(v) for v in args.ms.split(",")):
                for zeros in args.zeros.split(","):
                    r = measure(name, n, k, group, m, zeros)
                    rows.append(r)
                    print(
                        f"{name:>8} {n:>5} {k:>5} {r['group']!s:>7} {zeros:>5} {m:>5} "
                        f"{r['int4_us']:>8.2f} {r['bf16_us']:>8.2f} {r['speedup']:>7.2f} "
                        f"{r['max_err']:>8.1e}",
                        flush=True,
                    )
    if args.output_json:
        Path(args.output_json).write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
