"""FP8 GEMM variants against bf16 at the batched (W2 / W3) shapes of Llama-3.1-8B, one GPU.

    python benchmarks/bench_scaled_mm.py [--output-json FILE]
Times, per layer and M: bf16 F.linear; torch._scaled_mm with row-wise scales (what `fp8` runs,
without and with its per-token quantization) and tensor-wise scales, each with and without
use_fast_accum. Prints TFLOP/s and the speed-up over bf16: which cuBLAS / CUTLASS path is worth
taking for the 1.5x W2 bar.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

from slipstream.quantization.fp8 import _quantize_per_token_cuda

LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}
F8 = torch.float8_e4m3fn


def time_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


def variants(x: torch.Tensor, w: torch.Tensor) -> dict:
    n = w.shape[0]
    wq = w.to(F8)
    xq, xs = _quantize_per_token_cuda(x)
    ws_row = torch.ones(1, n, device=x.device)
    one = torch.ones((), device=x.device)

    def rowwise(fast: bool):
        return lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws_row,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)

    def tensorwise(fast: bool):
        return lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)

    def quant_rowwise():
        q, s = _quantize_per_token_cuda(x)
        return torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws_row, out_dtype=torch.bfloat16)

    return {"bf16": lambda: F.linear(x, w), "fp8_row": rowwise(False),
            "fp8_row_fast": rowwise(True), "fp8_tensor": tensorwise(False),
            "fp8_tensor_fast": tensorwise(True), "fp8_row+quant": quant_rowwise}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", default="512,2048,8192")
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()
    rows = []
    for m in map(int, ns.m.split(",")):
        for name, (n, k) in LAYERS.items():
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            times = {}
            for label, fn in variants(x, w).items():
                try:
                    times[label] = time_us(fn)
                except RuntimeError as e:  # a scaling mode this torch / GPU does not offer
                    print(f"  {label} at M={m} {name}: {str(e).splitlines()[0][:100]}")
            flops = 2 * m * n * k
            cells = "  ".join(f"{lb} {flops / t / 1e6:6.0f} ({times['bf16'] / t:4.2f}x)"
                              for lb, t in times.items())
            print(f"M={m:<5} {name:<8} TFLOP/s: {cells}", flush=True)
            rows.append(dict(m=m, layer=name, n=n, k=k, us=times))
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                                        torch=torch.__version__, rows=rows),
                                                   indent=1))


if __name__ == "__main__":
    main()
