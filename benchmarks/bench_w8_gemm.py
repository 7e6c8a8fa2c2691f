"""int8_wo above 16 rows: the W8A16 GEMM's tiles against convert + cuBLAS and bf16 cuBLAS.

For each Llama-3.1-8B layer shape and M: bf16 F.linear on a random weight, then the same weight
quantized to INT8 per channel through every w8_gemm candidate, convert + cuBLAS (the path before
the kernel), and int8_linear's measured choice. Graph-timed medians over L2-sized weight copies
(kernels/runtime/tuning.py), TFLOP/s, the ratio to bf16 and the error against the float32 reference.

  python benchmarks/bench_w8_gemm.py --output-json $OUT/w8_gemm.json [--ms 32,64,256,2048] [--sweep]

--sweep times a grid of tiles in both operand orders (x @ w^T, and w @ x^T with the converted
weight tile as the register operand) and, up to 64 rows, split-K, instead of the tuner's
candidates, to choose them.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from slipstream.kernels.gemm import int8 as gemm_int8
from slipstream.kernels.gemv.int8 import qgemv_reference
from slipstream.kernels.runtime.tuning import graph_time_us, weight_copies
from slipstream.quantization import utils as qu
from slipstream.quantization.int8_wo import convert_linear, int8_linear

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # (N, K)


def sweep_configs(m: int) -> list[gemm_int8.W8GemmConfig]:
    """The --sweep grid: (block_m, block_n, block_k, warps, stages) tiles, both operand orders;
    up to 64 rows also split-K 2 / 4 of the narrow tiles."""
    if m <= 64:
        tiles = [(32, 128, 128, 4, 4), (64, 128, 128, 4, 4), (64, 64, 256, 4, 3),
                 (32, 64, 256, 4, 4), (16, 128, 256, 4, 4), (32, 256, 128, 8, 3),
                 (64, 64, 128, 4, 4), (16, 64, 256, 4, 4)]
    else:
        tiles = [(128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
                 (64, 128, 128, 4, 4), (128, 128, 64, 4, 4), (64, 256, 64, 8, 3),
                 (128, 128, 128, 4, 3), (128, 256, 128, 8, 3)]
    grid = [gemm_int8.W8GemmConfig(*t, swap_ab=sw) for sw in (False, True) for t in tiles]
    if m <= 64:  # split-K: more programs for the narrow shapes (o, qkv: 32-100 tiles of 64 rows)
        grid += [gemm_int8.W8GemmConfig(*t, swap_ab=sw, split_k=sk) for sk in (2, 4)
                 for t, sw in [((16, 64, 256, 4, 4), False), ((32, 64, 256, 4, 4), False),
                               ((32, 64, 256, 4, 4), True), ((64, 128, 128, 4, 4), True)]]
    return grid


def bench_case(name: str, n: int, k: int, m: int, sweep: bool = False) -> dict:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, s = qu.quantize_int8_per_channel(w)
    want = qgemv_reference(x.float(), q, s).float()
    flops = 2 * m * n * k
    cands = [("bf16 cuBLAS", F.linear, (x, w))]
    cands += [(c.label(), lambda *a, c=c: gemm_int8.w8_gemm(*a, None, c), (x, q, s))
              for c in (sweep_configs(m) if sweep else
                        gemm_int8.candidate_gemm_configs(gemm_int8.large_m_bucket(m)))]
    cands += [(gemm_int8.CUBLAS, lambda *a: convert_linear(*a, None), (x, q, s)),
              ("int8_linear (measured choice)", lambda *a: int8_linear(*a, None), (x, q, s))]
    rows = []
    for label, fn, args in cands:
        try:
            got = fn(*args).float()
            err = ((got - want).norm() / want.norm()).item() if args[1] is q else None
            us = graph_time_us(lambda a, fn=fn: fn(*a), weight_copies(args))
            rows.append({"impl": label, "us": us, "tflops": flops / us / 1e6, "rel_err": err})
        except Exception as exc:  # a tile that does not fit: record and go on
            rows.append({"impl": label, "error": str(exc)[:200]})
    bf16_us = rows[0]["us"]
    ok = [r for r in rows[1:-2] if "us" in r and r["rel_err"] < 1e-2]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    return {"layer": name, "n": n, "k": k, "m": m, "bf16_us": bf16_us, "w8_best": best,
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="32,64,256,2048")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="a grid of tiles, not the candidates")
    ap.add_argument("--output-json")
    ns = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    results = []
    for m in [int(v) for v in ns.ms.split(",")]:
        for name in ns.shapes.split(","):
            r = bench_case(name, *SHAPES[name], m, ns.sweep)
            results.append(r)
            print(f"\nM={m} {name} N={r['n']} K={r['k']}: bf16 {r['bf16_us']:.1f} us", flush=True)
            for x in r["rows"]:
                if "error" in x:
                    print(f"  {x['impl']:<40} ERROR {x['error'][:70]}")
                    continue
                err = "" if x["rel_err"] is None else f" err {x['rel_err']:.1e}"
                print(f"  {x['impl']:<40} {x['us']:9.1f} us {x['tflops']:7.1f} TFLOP/s "
                      f"x{r['bf16_us'] / x['us']:.2f} bf16{err}")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
