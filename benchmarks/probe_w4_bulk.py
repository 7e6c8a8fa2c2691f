"""Does a CUDA C++ one-row int4 GEMV fed by bulk asynchronous copies (kernels/w4_bulk.cu: a
producer warp, a shared-memory ring, consumers on the tensor cores) beat the Triton one-row
kernels the tuner picks?

Each shape's production time is w4_linear_small's (the tuner's measured choice for a plain
product); each bulk config is (consumer warps, ring stages, blocks). Both are graph-timed over
weight copies past L2, back to back (idle 0) and after a one-program spin of IDLE us (a stand-in
for attention, under which a PDL launch may already stream weights). Checked against the
float reference first.

  python benchmarks/probe_w4_bulk.py --shapes gate_up,qkv,o --output-json F
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

# run as a script, this folder is on the path: the shared operands and reporting
from probe_w4_overlap import SHAPES, dump_rows, print_row, random_w4  # noqa: E402

from slipstream.kernels import gemv_int4  # noqa: E402
from slipstream.kernels.gemv_int4_bulk import w4_gemv_bulk  # noqa: E402
from slipstream.kernels.int4_common import w4_linear_reference  # noqa: E402
from slipstream.kernels.tuning import graph_time_us, weight_copies  # noqa: E402

GROUP = 128


def _times(run, copies, idles: list[float]) -> dict:
    return {f"us_idle{idle:g}": graph_time_us(run, copies, idle_before_us=idle) for idle in idles}


def _bulk_row(name, x, words, scales, zeros, ref, tol, spec: str, variant: str,
              idles: list[float]) -> dict:
    cw, st, blocks = (int(v) for v in spec.split(":"))
    mode = {"copies": 1, "math": 2, "bf16math": 2}.get(variant, 0)
    xq = 0 if variant.startswith("bf16") else 2
    kw = dict(cwarps=cw, stages=st, grid=blocks or None, mode=mode, pdl=variant != "nopdl", xq=xq)
    row = dict(shape=name, kernel="bulk", variant=variant, cwarps=cw, stages=st, blocks=blocks)
    try:
        out = w4_gemv_bulk(x, words.view(torch.uint8), scales, zeros, **kw)
        torch.cuda.synchronize()
        if mode == 0:
            row["max_err"] = float((out.float() - ref).abs().max())
            row["ok"] = row["max_err"] <= tol
        row.update(_times(lambda a: w4_gemv_bulk(x, a[0].view(torch.uint8), a[1], a[2], out=out,
                                                 **kw),
                          weight_copies((words, scales, zeros)), idles))
    except Exception as exc:  # report and go on
        row["error"] = str(exc)[:300]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output-json", default="")
    ap.add_argument("--shapes", default="gate_up,qkv,o")
    ap.add_argument("--configs", default="8:5:0,8:3:0,8:6:0,4:5:0,16:4:0",
                    help="consumer warps:stages:blocks (0 = one an SM, at most the tiles)")
    ap.add_argument("--idle", default="0,8")
    ap.add_argument("--variants", default="full",
                    help="full, copies (MODE 1), math (MODE 2), nopdl (full without PDL); bf16, bf16math: "
                         "the same on bf16 mma (XQ 0)")
    ns = ap.parse_args()
    idles = [float(v) for v in ns.idle.split(",")]
    rows = []
    for name in ns.shapes.split(","):
        n, k = SHAPES[name]
        x, words, scales, zeros = random_w4(n, k)
        qweight = words.view(torch.uint8)
        ref = w4_linear_reference(x, qweight, scales, zeros, GROUP).float()
        tol = 2e-2 * ref.abs().max().item()
        prod = gemv_int4.w4_linear_small(x, qweight, scales, zeros, GROUP)
        row = dict(shape=name, kernel="production",
                   max_err=float((prod.float() - ref).abs().max()), tol=tol,
                   **_times(lambda a, x=x: gemv_int4.w4_linear_small(
                       x, a[0].view(torch.uint8), a[1], a[2], GROUP),
                       weight_copies((words, scales, zeros)), idles))
        print_row(row)
        rows.append(row)
        for spec, variant in itertools.product(ns.configs.split(","), ns.variants.split(",")):
            row = _bulk_row(name, x, words, scales, zeros, ref, tol, spec, variant, idles)
            print_row(row)
            rows.append(row)
    dump_rows(ns.output_json, rows)


if __name__ == "__main__":
    main()
