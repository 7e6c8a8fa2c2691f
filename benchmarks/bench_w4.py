"""W4A16 (int4_awq, group 128) kernels against bf16 F.linear on the Llama-3.1-8B layer shapes.

For each (N, K) and M: bf16 cuBLAS and the engine's bf16 `linear` (Triton GEMV for M <= 16) on a
random bf16 weight; then the same weight quantized to int4 through every candidate config of
w4_gemv (M <= 16) or w4_gemm (M > 16), dequantize + cuBLAS, and int4_linear's measured choice.
Times are CUDA-graph medians over L2-sized weight copies (kernels/runtime/tuning.py: as the decode
graph runs them, without Python launch cost). Prints effective GB/s (weight bytes
incl. scales / zeros, plus activations), TFLOP/s, the speed-up over bf16 (the better of cuBLAS
and the engine's linear) and the max error against the reference; `--output-json` keeps it all.

  python benchmarks/bench_w4.py --output-json $OUT/w4.json [--ms 1,16,256,2048] [--group 128]

--sweep times a grid instead of the tuner's candidates, to choose them: at one row the chained
kernel over tile (32-128 rows, 2-8 warps), chunks requested ahead (1-3, or 2-3 through shared
memory: num_stages 3-4) and split (auto, 2, 4);
at 2-16 rows the mma kernel over tiles, prefetch and groups a step, and at 2-4 rows the few-row
kernel over tiles, chunks ahead and split.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

from slipstream.kernels import triton_ops
from slipstream.kernels.gemm import int4 as gemm_int4
from slipstream.kernels.gemv import int4 as gemv_int4
from slipstream.kernels.runtime.tuning import graph_time_us, weight_copies
from slipstream.quantization import utils as qu

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # (N, K)


def time_ms(fn: Callable[..., object], args: tuple[torch.Tensor, ...]) -> float:
    """Graph-timed milliseconds per call of fn(*args), cycling through copies of args."""
    return graph_time_us(lambda a: fn(*a), weight_copies(args)) / 1e3


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    # do_bench: launch cost is nothing beside a 1 GiB copy (graph-timed copies read ~35% low).
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    return 2 * src.numel() / ms / 1e6


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def row(impl: str, ms: float, nbytes: int, flops: int, err: float | None = None) -> dict:
    return {"impl": impl, "us": 1e3 * ms, "gbps": nbytes / ms / 1e6,
            "tflops": flops / ms / 1e9, "max_err": err}


def sweep_configs(m: int) -> list[gemv_int4.W4Config]:
    """The --sweep grid (see the module docstring)."""
    W4 = gemv_int4.W4Config
    if m == 1:
        return [W4(bn, 128, sk, w, st, pf, bit_convert=2)
                for bn, w in [(32, 2), (64, 2), (64, 4), (128, 4), (128, 8)]
                for pf, st in [(1, 1), (2, 1), (3, 1), (0, 3), (0, 4)] for sk in (0, 2, 4)]
    few = [W4(bn, 128, sk, w, 1, pf, bit_convert=2, two_rows=m == 2, four_rows=m > 2)
           for bn, w in [(64, 2), (64, 4), (128, 4), (128, 8)] for pf in (1, 2, 3)
           for sk in (0, 4)] if m <= 4 else []
    return few + [W4(16 * tiles * w, bk, 0, w, 1, pf, mma=True)
                  for tiles in (1, 2) for w in (2, 4, 8)
                  for pf, bk in [(False, 128), (True, 128), (False, 256), (False, 512)]]


def bench_case(name: str, n: int, k: int, m: int, group: int, sweep: bool = False) -> dict:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, s, z = qu.quantize_int4_groupwise(w, group)
    packed = (qu.pack_int4_rows(q), s.half(), z)
    del q, s, z
    act = 2 * m * (k + n)
    flops = 2 * m * n * k
    bf16_bytes, w4_bytes = 2 * n * k + act, n * k // 2 + 3 * n * (k // group) + act
    rows = [row("bf16 cuBLAS", time_ms(F.linear, (x, w)), bf16_bytes, flops),
            row("bf16 engine linear", time_ms(triton_ops.linear, (x, w)), bf16_bytes, flops)]
    want = gemv_int4.w4_linear_reference(x, *packed, group)
    if m <= gemv_int4.MAX_M:
        configs = sweep_configs(m) if sweep else gemv_int4.candidate_w4_configs(m, x.dtype)
        cands = [(c.label(), lambda *a, c=c: gemv_int4.w4_gemv(*a, group, None, c))
                 for c in configs]
    else:
        cands = [(c.label(), lambda *a, c=c: gemm_int4.w4_gemm(*a, group, None, c))
                 for c in gemm_int4.candidate_gemm_configs(m)]
        cands.append((gemm_int4.CUBLAS, lambda *a: gemm_int4.w4_dequant_linear(*a, group)))
    cands.append(("int4_linear (measured choice)",
                  lambda *a: gemv_int4.int4_linear(*a, group)))
    for label, fn in cands:
        try:
            err = max_err(fn(x, *packed), want)
            rows.append(row(label, time_ms(fn, (x, *packed)), w4_bytes, flops, err))
        except Exception as exc:  # a tile that does not fit: record and go on
            rows.append({"impl": label, "error": str(exc)[:200]})
    bf16_us = min(r["us"] for r in rows[:2])
    ok = [r for r in rows[2:] if "us" in r and r["max_err"] < 2e-2]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    return {"layer": name, "n": n, "k": k, "m": m, "group": group, "bf16_us": bf16_us,
            "w4_best": best, "speedup": bf16_us / best["us"] if best else None, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,16,256,2048")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="a grid of configs (M <= 16)")
    ap.add_argument("--output-json")
    ns = ap.parse_args()
    peak = copy_gbps()
    print(f"copy bandwidth {peak:.0f} GB/s ({torch.cuda.get_device_name()})", flush=True)
    results = []
    for m in [int(v) for v in ns.ms.split(",")]:
        for name in ns.shapes.split(","):
            n, k = SHAPES[name]
            r = bench_case(name, n, k, m, ns.group, ns.sweep)
            results.append(r)
            print(f"\nM={m} {name} N={n} K={k}: bf16 {r['bf16_us']:.1f} us, best w4 "
                  f"{r['w4_best']['us'] if r['w4_best'] else float('nan'):.1f} us "
                  f"(x{r['speedup'] or float('nan'):.2f})", flush=True)
            for x in r["rows"]:
                if "error" in x:
                    print(f"  {x['impl']:<48} ERROR {x['error'][:60]}")
                    continue
                err = "" if x["max_err"] is None else f" err {x['max_err']:.1e}"
                print(f"  {x['impl']:<48} {x['us']:9.1f} us {x['gbps']:7.0f} GB/s "
                      f"({100 * x['gbps'] / peak:5.1f}% copy) {x['tflops']:7.1f} TFLOP/s{err}")
    # Batch-1 decode: the four projections of 32 layers (lm_head and attention not counted).
    dec = [r for r in results if r["m"] == 1 and r["w4_best"]]
    if len(dec) == len(SHAPES):
        bf16 = 32 * sum(r["bf16_us"] for r in dec)
        w4 = 32 * sum(r["w4_best"]["us"] for r in dec)
        print(f"\nM=1 projections x 32 layers: bf16 {bf16 / 1e3:.3f} ms, w4 {w4 / 1e3:.3f} ms "
              f"(x{bf16 / w4:.2f})")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(
            {"copy_gbps": peak, "device": torch.cuda.get_device_name(), "results": results},
            indent=2))


if __name__ == "__main__":
    main()
