"""Run each decode linear's measured kernel once inside a profiler range, for Nsight Compute.

For every format (bf16, fp8, int4), Llama-3.1-8B layer shape and row count: tune as the engine
does (first call), print the choice, then run it once between cudaProfilerStart / Stop, so
`ncu --profile-from-start off` reads exactly the kernels the decode step runs:

  ncu --clock-control none --profile-from-start off --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 benchmarks/ncu_linears.py --formats int4 --ms 1,4
"""
from __future__ import annotations

import argparse

import torch

from slipstream.kernels import gemv_int4, gemv_int8, triton_ops
from slipstream.quantization import utils as qu

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # (N, K)
GROUP = 128


def prepared(fmt: str, n: int, k: int):
    """(call(x), label of the measured choice after the first call)."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    if fmt == "bf16":
        return lambda x: triton_ops.linear(x, w), lambda: "engine linear"
    if fmt == "fp8":
        q, s = qu.quantize_fp8_per_channel(w)
        return (lambda x: gemv_int8.qlinear_small(x, q, s),
                lambda: "see gemv_int8 choices")
    q, s, z = qu.quantize_int4_groupwise(w, GROUP)
    packed = (qu.pack_int4_rows(q), s.half(), z)
    return (lambda x: gemv_int4.w4_linear_small(x, *packed, GROUP),
            lambda: str(gemv_int4.w4_choices()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,fp8,int4")
    ap.add_argument("--ms", default="1,4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ns = ap.parse_args()
    for fmt in ns.formats.split(","):
        for name in ns.shapes.split(","):
            n, k = SHAPES[name]
            call, choice = prepared(fmt, n, k)
            for m in map(int, ns.ms.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                call(x)  # measures the choice
                torch.cuda.synchronize()
                print(f"{fmt} {name} M={m}", flush=True)
                torch.cuda.cudart().cudaProfilerStart()
                call(x)
                torch.cuda.synchronize()
                torch.cuda.cudart().cudaProfilerStop()
            if fmt == "int4":
                print(choice(), flush=True)


if __name__ == "__main__":
    main()
