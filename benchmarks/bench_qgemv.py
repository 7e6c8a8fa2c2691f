"""Decode GEMV per weight format: every candidate config on the Llama-3.1-8B layer shapes.

For bf16 (kernels/gemv/dense.py), int8 and fp8 (kernels/gemv/int8.py) weights, times each candidate
config at M=1 (--m: another row count, up to 16) and prints the best, its effective bandwidth
and its share of the device-to-device copy bandwidth measured in the same run. Shows which
tiles the start-up tuner should consider and how far each format is from streaming its bytes at
copy speed.

  python benchmarks/bench_qgemv.py --output-json $OUT/qgemv.json

--prefetch-depths 2,3 also times each one-row candidate that prefetches with its tiles requested
that many ahead (three or four in flight instead of two). --idle-us T times each call after a
kernel that spins T us (as after decode attention; tuning.graph_time_us): the cost a GEMV adds
there, where tiles requested before the PDL wait (one-row prefetch, whole-K tiles) overlap it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from slipstream.bench.latency import measure_copy_bandwidth
from slipstream.kernels.gemv import dense as gemv
from slipstream.kernels.gemv import int8 as gemv_int8
from slipstream.kernels.runtime.tuning import graph_time_us, weight_copies
from slipstream.quantization import utils

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
          "down": (14336, 4096), "lm_head": (4096, 128256)}


def copy_gbps() -> float:
    # Eager, as `slipstream bench latency` measures it: the same copy captured in a CUDA graph
    # (a memcpy node) read 2,643 GB/s on the H200 against ~4,140 eager.
    return measure_copy_bandwidth("cuda") / 1e9


def with_depths(configs: list, depths: list[int]) -> list:
    """configs, then each prefetching one again with prefetch = d for d in depths."""
    return configs + [dataclasses.replace(c, prefetch=d) for d in depths for c in configs
                      if c.prefetch is True]


def bench_shape(name: str, k: int, n: int, fmt: str, m: int = 1,
                depths: list[int] | None = None, idle_us: float = 0.0) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    if fmt == "bf16":
        configs = gemv.candidate_configs(m, n, k)
        sets = weight_copies((x, w))
        run = lambda cfg: lambda a: gemv.gemv(*a, config=cfg)  # noqa: E731
        nbytes = w.numel() * 2
        rows = [{"config": "cuBLAS",
                 "us": graph_time_us(lambda a: torch.nn.functional.linear(*a), sets,
                                     idle_before_us=idle_us)}]
    else:
        q, s = (utils.quantize_int8_per_channel(w) if fmt == "int8"
                else utils.quantize_fp8_per_channel(w))
        configs = gemv_int8.candidate_qconfigs(m, q.dtype, k)
        sets = weight_copies((x, q, s))
        run = lambda cfg: lambda a: gemv_int8.qgemv(*a, config=cfg)  # noqa: E731
        nbytes = q.numel()
        rows = []
    for cfg in with_depths(configs, depths or []):
        try:
            rows.append({"config": repr(cfg),
                         "us": graph_time_us(run(cfg), sets, idle_before_us=idle_us)})
        except Exception as exc:  # a tile that does not fit: skip
            rows.append({"config": repr(cfg), "error": str(exc)[:200]})
    ok = [r for r in rows if "us" in r]
    best = min(ok, key=lambda r: r["us"])
    return {"layer": name, "format": fmt, "m": m, "k": k, "n": n, "bytes": nbytes, "best": best,
            "best_gbps": nbytes / best["us"] / 1e3, "all": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,int8,fp8")
    ap.add_argument("--m", type=int, default=1, help="activation rows (1-16)")
    ap.add_argument("--prefetch-depths", default="", help="e.g. 2,3: deeper one-row prefetch")
    ap.add_argument("--idle-us", type=float, default=0.0,
                    help="time each call after a kernel spinning this long (see the docstring)")
    ap.add_argument("--output-json")
    ns = ap.parse_args()
    depths = [int(d) for d in ns.prefetch_depths.split(",") if d]
    peak = copy_gbps()
    results = []
    print(f"copy bandwidth {peak:.0f} GB/s")
    print(f"{'layer':<8} {'fmt':<5} {'best us':>8} {'GB/s':>7} {'% copy':>7}  config")
    step = {}
    for fmt in ns.formats.split(","):
        for name, (k, n) in SHAPES.items():
            r = bench_shape(name, k, n, fmt, ns.m, depths, ns.idle_us)
            results.append(r)
            mult = 32 if name != "lm_head" else 1
            step[fmt] = step.get(fmt, 0.0) + mult * r["best"]["us"]
            print(f"{name:<8} {fmt:<5} {r['best']['us']:8.1f} {r['best_gbps']:7.0f} "
                  f"{100 * r['best_gbps'] / peak:6.1f}%  {r['best']['config']}", flush=True)
    for fmt, us in step.items():
        print(f"GEMV-only decode step {fmt}: {us / 1e3:.3f} ms")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"copy_gbps": peak, "results": results, "step_ms": step}, f, indent=1)


if __name__ == "__main__":
    main()
