"""The start-up tuner's choice for each one-row linear fed by an RMSNorm (Llama-3.1-8B's qkv and
gate_up): the add + norm kernel followed by the layer's measured linear, against the GEMV that
computes the norm while loading its input (kernels/gemv.py NORMED), graph-timed as the tuner
times them. Prints the tuner's log lines; GPU only.

    python benchmarks/bench_norm_gemv.py
"""
from __future__ import annotations

import logging

import torch

from slipstream.kernels import gemv_int8, triton_ops
from slipstream.quantization import utils

SHAPES = {"qkv": (6144, 4096), "gate_up": (28672, 4096)}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dev, eps = torch.device("cuda"), 1e-5
    for name, (n, k) in SHAPES.items():
        print(f"--- {name} N={n} K={k}")
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64
        triton_ops._measure_normed(w, None, torch.bfloat16, eps)
        for quantize in (utils.quantize_fp8_per_channel, utils.quantize_int8_per_channel):
            q, s = quantize(w.float())
            gemv_int8._measure_normed(q, s, None, torch.bfloat16, eps)


if __name__ == "__main__":
    main()
