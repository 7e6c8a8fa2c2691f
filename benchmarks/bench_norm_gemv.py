"""One-row linears fed by an RMSNorm (Llama-3.1-8B's qkv and gate_up), graph-timed as the start-up
tuner times them: the add + norm kernel followed by the layer's measured linear, against the GEMV
that computes the norm while loading its input (kernels/gemv.py NORMED; 1: norm only, 2: residual
add + norm + the new residual's store). Per weight dtype, the best config of each. GPU only.

    python benchmarks/bench_norm_gemv.py [--output-json FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from slipstream.kernels import gemv, gemv_int8, triton_ops
from slipstream.kernels.rms_norm import fused_add_rms_norm
from slipstream.kernels.tuning import graph_time_us, weight_copies
from slipstream.quantization import utils

SHAPES = {"qkv": (6144, 4096), "gate_up": (28672, 4096)}
EPS = 1e-5


def _best(call, configs, arg_sets) -> tuple[float, object]:
    best = (float("inf"), None)
    for cfg in configs:
        try:
            best = min(best, (graph_time_us(lambda a, cfg=cfg: call(a, cfg), arg_sets), cfg),
                       key=lambda t: t[0])
        except Exception:  # a config that does not fit this shape
            continue
    return best


def _row(name: str, weights: tuple, plain, normed, configs) -> dict:
    k = weights[0].shape[1]
    dev = weights[0].device
    x, res = (torch.randn((1, k), device=dev, dtype=torch.bfloat16) for _ in range(2))
    norm_w = (torch.rand(k, device=dev) + 0.5).to(torch.bfloat16)
    sets = weight_copies((x, res, norm_w) + weights)
    one_split = list(dict.fromkeys(dataclasses.replace(c, split_k=1) for c in configs))
    plain_us, plain_cfg = _best(lambda a, c: plain(a[0], *a[3:], c), configs, sets)
    norm_us = graph_time_us(lambda a: fused_add_rms_norm(a[0], a[1], a[2], EPS), sets)
    row = {"layer": name, "plain_us": plain_us, "norm_kernel_us": norm_us,
           "plain_cfg": repr(plain_cfg)}
    for mode, residual in ((1, False), (2, True)):
        us, cfg = _best(lambda a, c, r=residual: normed(a[0], a[1] if r else None,
                                                        gemv.NormInput(a[2], EPS), *a[3:], c),
                        one_split, sets)
        row[f"normed{mode}_us"], row[f"normed{mode}_cfg"] = us, repr(cfg)
    print(f"{name:22s} plain {plain_us:6.1f}  norm {norm_us:4.1f}  normed1 {row['normed1_us']:6.1f}"
          f"  normed2 {row['normed2_us']:6.1f} us", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-json")
    args = parser.parse_args()
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        rows.append(_row(f"{name} bf16", (w,), lambda x, w, c: gemv.gemv(x, w, None, c),
                         lambda x, r, nm, w, c: gemv.gemv_normed(x, r, nm, w, None, c)[0],
                         gemv.candidate_configs(1, n, k)))
        for label, quantize in (("fp8", utils.quantize_fp8_per_channel),):
            q, s = quantize(w.float())  # int8 shares the kernel (and nearly the timings)
            rows.append(_row(
                f"{name} {label}", (q, s),
                lambda x, q, s, c: gemv_int8.qgemv(x, q, s, None, c),
                lambda x, r, nm, q, s, c: gemv_int8.qgemv_normed(x, r, nm, q, s, None, c)[0],
                [c for c in gemv_int8.candidate_qconfigs(1, q.dtype)
                 if not c.dot and c.bit_convert != 1]))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"rows": rows, "linear_choices": triton_ops.linear_choices()}, f, indent=1)


if __name__ == "__main__":
    main()
