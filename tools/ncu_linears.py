"""Run each decode linear's measured kernel once inside a profiler range, for Nsight Compute.

For every format (bf16, fp8, int4), Llama-3.1-8B layer shape and row count: tune as the engine
does (first call), then run it once between cudaProfilerStart / Stop, so that
`ncu --profile-from-start off` reads exactly the kernels the decode step runs (the int4
choices are printed at the end):

  ncu --clock-control none --profile-from-start off --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    python3 tools/ncu_linears.py --formats int4 --ms 1,4

--int4-configs SUBSTRING profiles, instead of int4's measured choice, every int4 candidate whose
label contains it (e.g. "mma" for the tensor-core GEMV at 2-16 rows; at one row it is no
candidate, kernels/gemv/int4_mma.MIN_ROWS), one profiler range each, its label printed before it.
"""
from __future__ import annotations

import argparse

import torch

from slipstream.kernels import triton_ops
from slipstream.kernels.gemv import int4 as gemv_int4
from slipstream.kernels.gemv import int8 as gemv_int8
from slipstream.quantization import utils as qu

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # (N, K)
GROUP = 128


def int4_candidates(n: int, k: int, m: int, substring: str):
    """[(label, call(x))]: the int4 GEMV candidates at m rows whose label contains substring."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    q, s, z = qu.quantize_int4_groupwise(w, GROUP)
    packed = (qu.pack_int4_rows(q), s.half(), z)
    return [(c.label(), lambda x, c=c: gemv_int4.w4_gemv(x, *packed, GROUP, None, c))
            for c in gemv_int4.candidate_w4_configs(m) if substring in c.label()]


def profiled(label: str, call, x: torch.Tensor) -> None:
    """call(x) once to compile / tune, then once between cudaProfilerStart and Stop."""
    call(x)
    torch.cuda.synchronize()
    print(label, flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    call(x)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def prepared(fmt: str, n: int, k: int):
    """call(x): the engine's decode linear of this format on a random [n, k] weight."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    if fmt == "bf16":
        return lambda x: triton_ops.linear(x, w)
    if fmt == "fp8":
        q, s = qu.quantize_fp8_per_channel(w)
        return lambda x: gemv_int8.qlinear_small(x, q, s)
    q, s, z = qu.quantize_int4_groupwise(w, GROUP)
    packed = (qu.pack_int4_rows(q), s.half(), z)
    return lambda x: gemv_int4.w4_linear_small(x, *packed, GROUP)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,fp8,int4")
    ap.add_argument("--ms", default="1,4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--int4-configs", default=None, help="int4: these candidates, not the choice")
    ns = ap.parse_args()
    for fmt in ns.formats.split(","):
        for name in ns.shapes.split(","):
            n, k = SHAPES[name]
            for m in map(int, ns.ms.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                if fmt == "int4" and ns.int4_configs is not None:
                    for label, call in int4_candidates(n, k, m, ns.int4_configs):
                        profiled(f"{fmt} {name} M={m} {label}", call, x)
                else:
                    profiled(f"{fmt} {name} M={m}", prepared(fmt, n, k), x)
    if "int4" in ns.formats.split(",") and ns.int4_configs is None:
        print(gemv_int4.w4_choices(), flush=True)


if __name__ == "__main__":
    main()
