"""W1-style batch-1 decode speed of each quantization method against bf16, side by side.

Runs `python -m slipstream bench latency` once per method (a fresh process each: no memory or
tuning state shared), Llama-3.1-8B shape with dummy weights, then prints a table of decode tok/s
and the ratio to bf16 and writes all results to --output-json.

  python benchmarks/bench_quant.py --methods none,int8_wo,fp8 --output-json $OUT/quant.json

A method written METHOD+head (fp8+head, int8_wo+head) also quantizes the LM head
(--quantize-lm-head), METHOD+head4 in int4 (--quantize-lm-head int4); its bar is the method's
own.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

BARS = {"fp8": 1.7, "int8_wo": 1.6, "int4_awq": 2.5}  # the W1 (batch-1 decode) targets against bf16


def run_one(method: str, args: argparse.Namespace, out_dir: Path) -> dict:
    out = out_dir / f"latency_{method}.json"
    log = ["--log-level", "INFO"] if args.show_tuning else []
    cmd = [sys.executable, "-m", "slipstream", *log, "bench", "latency", "--model", args.model,
           "--load-format", "dummy", "--batch-size", "1", "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--num-iters", str(args.num_iters),
           "--label", f"W1 {method}", "--output-json", str(out)]
    base, _, head = method.partition("+")
    if base != "none":
        cmd += ["--quantization", base]
    if head == "head":
        cmd.append("--quantize-lm-head")
    elif head == "head4":  # an int4 LM head (quantization/lm_head.py)
        cmd += ["--quantize-lm-head", "int4"]
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if args.show_tuning:  # the start-up tuner's choice per GEMV shape
        print("\n".join(line for line in proc.stderr.splitlines() if " us)" in line), flush=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], flush=True)
        return {"method": method, "error": proc.stderr[-2000:]}
    return {"method": method, **json.loads(out.read_text())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--methods", default="none,int8_wo,fp8,int4_awq",
                   help="comma-separated; 'none' is the bf16 baseline (always run first)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--output-json", default=None)
    p.add_argument("--show-tuning", action="store_true",
                   help="print the start-up tuner's choice for each GEMV shape")
    args = p.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    methods = ["none"] + [m for m in methods if m != "none"]
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in methods:
            results.append(run_one(method, args, Path(tmp)))
            # Each method's row as soon as it is measured, the JSON rewritten too: a run cut
            # short by a time limit keeps what it finished.
            row = _rows(results)[-1]
            print(f"= {_line(row)}", flush=True)
            if args.output_json:
                Path(args.output_json).write_text(
                    json.dumps({"rows": _rows(results), "runs": results}, indent=2))
    print(f"\n{'method':<13} {'decode tok/s':>13} {'x bf16':>8} {'bar':>6} {'TTFT ms':>8}")
    for row in _rows(results):
        print(_line(row))
    return 0


def _rows(results: list[dict]) -> list[dict]:
    """The table's rows: decode tok/s of each run and its ratio to the first (bf16) run."""
    base = _decode(results[0])
    rows = []
    for r in results:
        tok_s = _decode(r)
        ratio = tok_s / base if tok_s and base else None
        rows.append({"method": r["method"], "decode_tok_s": tok_s, "ratio_vs_bf16": ratio,
                     "bar": BARS.get(r["method"].partition("+")[0]), "sol_pct": r.get("sol_pct"),
                     "ttft_ms": (r.get("ttft_ms") or {}).get("median"),
                     "peak_mem_gib": (r.get("engine") or {}).get("peak_memory_gib")})
    return rows


def _line(row: dict) -> str:
    tok = f"{row['decode_tok_s']:.1f}" if row["decode_tok_s"] else "error"
    ratio = f"{row['ratio_vs_bf16']:.2f}" if row["ratio_vs_bf16"] else "-"
    bar = f"{row['bar']:.1f}" if row["bar"] else "-"
    ttft = f"{row['ttft_ms']:.1f}" if row["ttft_ms"] else "-"
    return f"{row['method']:<13} {tok:>13} {ratio:>8} {bar:>6} {ttft:>8}"


def _decode(result: dict) -> float | None:
    return (result.get("decode_tok_s") or {}).get("median")


if __name__ == "__main__":
    raise SystemExit(main())
