"""FP8 W8A8 tensor-core GEMV (kernels/gemv_fp8.py) against the dequant-GEMV (kernels/gemv_int8.py)
on the same FP8 weights: every candidate config of each, timed in a CUDA graph over weight copies
that do not fit in L2, on the Llama-3.1-8B layer shapes. Prints the best of each with its weight
bandwidth and its share of the device-to-device copy bandwidth measured in the same run.

A candidate that fails to compile or gives a wrong result is reported and skipped.
`down+act` is the down projection as decode runs it: x = [gate | up], silu(gate) * up formed in
the kernel (`fp8`), or by the activation kernel before a plain product (`fp8+act`).

  python benchmarks/bench_fp8_gemv.py --ms 1,4,16 --output-json $OUT/fp8_gemv.json
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from slipstream.kernels import gemv_fp8, gemv_int8
from slipstream.kernels.activation import silu_and_mul as silu_and_mul_kernel
from slipstream.kernels.reference import silu_and_mul
from slipstream.kernels.tuning import graph_time_us, weight_copies
from slipstream.quantization import utils

# name: (K, N, gated)
SHAPES = {"qkv": (4096, 6144, False), "o": (4096, 4096, False), "gate_up": (4096, 28672, False),
          "down": (14336, 4096, False), "down+act": (14336, 4096, True),
          "lm_head": (4096, 128256, False)}
STEP_LAYERS = {"qkv": 32, "o": 32, "gate_up": 32, "down+act": 32, "lm_head": 1}  # 8B decode


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / graph_time_us(lambda a: a[1].copy_(a[0]), [(src, dst)], 4) / 1e3


def time_candidates(configs: list, run: Callable, check: Callable[[torch.Tensor], bool],
                    sets: list) -> list[dict]:
    """One row per config: its time, or why it has none (compile error, wrong result)."""
    rows = []
    for cfg in configs:
        row: dict = {"config": repr(cfg)}
        try:
            if not check(run(cfg)(sets[0])):
                row["error"] = "wrong result"
            else:
                row["us"] = graph_time_us(run(cfg), sets)
        except Exception as exc:  # does not compile / does not fit: report, go on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            torch.cuda.synchronize()
        rows.append(row)
    return rows


def _summary(rows: list[dict], nbytes: int, peak: float) -> dict:
    ok = [r for r in rows if "us" in r]
    if not ok:
        return {"best": None, "all": rows}
    best = min(ok, key=lambda r: r["us"])
    gbps = nbytes / best["us"] / 1e3
    return {"best": best, "gbps": gbps, "pct_copy": 100 * gbps / peak, "all": rows}


def bench_shape(name: str, m: int, peak: float) -> dict:
    k, n, gated = SHAPES[name]
    x = torch.randn(m, 2 * k if gated else k, device="cuda", dtype=torch.bfloat16)
    q, s = utils.quantize_fp8_per_channel(torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
    sets = weight_copies((x, q, s))

    def close_to(want: torch.Tensor) -> Callable[[torch.Tensor], bool]:
        tol = 2e-2 * want.float().abs().max().item()
        return lambda got: bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=tol))

    fp8_rows = time_candidates(
        gemv_fp8.candidate_fp8_configs(m),
        lambda cfg: lambda a: gemv_fp8.fp8_gemv(*a, config=cfg, gated=gated),
        close_to(gemv_fp8.fp8_gemv_reference(x, q, s, gated=gated)), sets)
    dq_rows = time_candidates(
        gemv_int8.candidate_qconfigs(m),
        lambda cfg: lambda a: gemv_int8.qgemv(*a, config=cfg, gated=gated),
        close_to(gemv_int8.qgemv_reference(silu_and_mul(x) if gated else x, q, s)), sets)
    nbytes = q.numel()
    out = {"layer": name, "m": m, "k": k, "n": n, "gated": gated, "bytes": nbytes,
           "fp8": _summary(fp8_rows, nbytes, peak), "dequant": _summary(dq_rows, nbytes, peak)}
    if gated:  # the alternative fp8_linear_small also measures: activation kernel, then fp8
        out["fp8+act"] = _summary(time_candidates(
            gemv_fp8.candidate_fp8_configs(m),
            lambda cfg: lambda a: gemv_fp8.fp8_gemv(silu_and_mul_kernel(a[0]), *a[1:], config=cfg),
            close_to(gemv_fp8.fp8_gemv_reference(x, q, s, gated=True)), sets), nbytes, peak)
    return out


def _line(r: dict, kernel: str) -> str:
    s = r[kernel]
    head = f"{r['layer']:<9} {r['m']:>3} {kernel:<8}"
    if s["best"] is None:
        return f"{head} {'-':>8} {'-':>7} {'-':>7}  no candidate ran"
    failed = sum("error" in row for row in s["all"])
    note = f"  ({failed} failed)" if failed else ""
    return (f"{head} {s['best']['us']:8.1f} {s['gbps']:7.0f} {s['pct_copy']:6.1f}%  "
            f"{s['best']['config']}{note}")


def _best_us(r: dict, *kernels: str) -> float:
    times = [r[k]["best"]["us"] for k in kernels if k in r and r[k]["best"] is not None]
    return min(times, default=float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1", help="comma-separated batch rows, each <= 16")
    ap.add_argument("--layers", default=",".join(SHAPES))
    ap.add_argument("--output-json")
    ns = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (8, 9):
        raise SystemExit("FP8 needs compute capability 8.9+")
    peak = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {peak:.0f} GB/s")
    print(f"{'layer':<9} {'M':>3} {'kernel':<8} {'best us':>8} {'GB/s':>7} {'% copy':>7}  config")
    results, step = [], {}
    for m in (int(v) for v in ns.ms.split(",")):
        for name in ns.layers.split(","):
            try:
                r = bench_shape(name, m, peak)
            except Exception as exc:  # e.g. out of memory: report the shape, go on
                print(f"{name:<9} {m:>3} failed: {type(exc).__name__}: {str(exc)[:200]}")
                torch.cuda.empty_cache()
                continue
            results.append(r)
            for kernel in ("fp8", "fp8+act", "dequant"):
                if kernel in r:
                    print(_line(r, kernel), flush=True)
            if name in STEP_LAYERS:  # fp8: what fp8_linear_small picks (either gated form)
                for kernel, us in (("fp8", _best_us(r, "fp8", "fp8+act")),
                                   ("dequant", _best_us(r, "dequant"))):
                    key = f"M={m} {kernel}"
                    step[key] = step.get(key, 0.0) + STEP_LAYERS[name] * us
    for key, us in step.items():
        print(f"GEMV-only decode step ({', '.join(STEP_LAYERS)}) {key}: {us / 1e3:.3f} ms")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_gbps": peak,
                       "results": results, "step_ms": {k: v / 1e3 for k, v in step.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
