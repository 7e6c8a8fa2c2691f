"""Kernel micro-benchmarks on one GPU: each Triton kernel against its torch reference / cuBLAS.

Times with triton.testing.do_bench (median; it also flushes L2 before every call) over input sets
rotated so that together they exceed twice the L2; measures device-to-device copy bandwidth in
the same run and prints achieved GB/s and % of it (table last). Shapes: Llama-3.1-8B, bf16.

    python benchmarks/bench_kernels.py --output-json $OUT/k.json [--quick] [--skip-step]
"""
from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing

from slipstream.bench.attn_batch import make_batch
from slipstream.kernels import reference, triton_ops
from slipstream.kernels.attention import paged as pa
from slipstream.kernels.attention.rotary_cache import rotary_and_cache_write
from slipstream.kernels.gemv import dense as gemv
from slipstream.kernels.norm_act.activation import silu_and_mul
from slipstream.kernels.norm_act.rms_norm import fused_add_rms_norm, rms_norm

DEV, DT = "cuda", torch.bfloat16
H, HQ, HKV, D, INTER, VOCAB, LAYERS = 4096, 32, 8, 128, 14336, 128256, 32
GEMV_SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
               "down": (14336, 4096), "lm_head": (4096, 128256)}
ATTN_CASES = [
    ("decode B=1 ctx=1k", [1], [1024]), ("decode B=1 ctx=8k", [1], [8192]),
    ("decode B=8 ctx=4k", [1] * 8, [4096] * 8), ("decode B=64 ctx=1k", [1] * 64, [1024] * 64),
    ("decode B=256 ctx=512", [1] * 256, [512] * 256), ("prefill 1x2048", [2048], [2048]),
    ("mixed 4x512@2k + 64 dec@1k", [512] * 4 + [1] * 64, [2048] * 4 + [1024] * 64),
]


class Bench:
    """Copy bandwidth, L2 size and the result rows of one run."""

    def __init__(self) -> None:
        props = torch.cuda.get_device_properties(0)
        self.l2 = getattr(props, "L2_cache_size", 0) or (60 << 20)
        self.rows: list[dict[str, Any]] = []
        src = torch.randn(1 << 29, device=DEV, dtype=DT)  # 1 GiB
        dst = torch.empty_like(src)
        self.copy_gbps = 2 * src.numel() * 2 / time_ms(lambda: dst.copy_(src)) / 1e6

    def rotating(self, make: Callable[[], Any], set_bytes: int) -> Callable[[], Any]:
        """A getter cycling through enough input sets to exceed 2x L2 (at most 32, 4 GB)."""
        n = max(1, min(32, math.ceil(2 * self.l2 / max(set_bytes, 1)),
                       (4 << 30) // max(set_bytes, 1)))
        sets = [make() for _ in range(n)]
        state = [0]

        def get() -> Any:
            state[0] = (state[0] + 1) % n
            return sets[state[0]]

        return get

    def record(self, kernel: str, shape: str, nbytes: int, ms: float, ref_ms: float | None = None,
               err: float | None = None, impl: str = "triton", flops: float = 0.0,
               **extra: Any) -> None:
        gbps = nbytes / ms / 1e6
        self.rows.append(dict(kernel=kernel, shape=shape, impl=impl, bytes=nbytes, ms=ms,
                              ref_ms=ref_ms, speedup=ref_ms / ms if ref_ms else None, gbps=gbps,
                              pct_copy=100 * gbps / self.copy_gbps, rel_err=err,
                              tflops=flops / ms / 1e9 if flops else None, **extra))


def time_ms(fn: Callable[[], Any]) -> float:
    """Median milliseconds per call."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def pair(b: Bench, kernel: str, shape: str, nbytes: int, get: Callable[[], Any],
         fast: Callable[..., Any], ref: Callable[..., Any], out_of: Callable[[Any], Any]) -> None:
    """Time fast(*get()) against ref(*get()) and record the relative error of one output."""
    args = get()
    err = rel_err(out_of(fast(*args)), out_of(ref(*args)))
    b.record(kernel, shape, nbytes, time_ms(lambda: fast(*get())), time_ms(lambda: ref(*get())),
             err)


def bench_norms(b: Bench, t: int) -> None:
    w = torch.randn(H, device=DEV, dtype=DT)
    get = b.rotating(lambda: (torch.randn(t, H, device=DEV, dtype=DT), w, 1e-5), t * H * 2)
    pair(b, "rms_norm", f"T={t} H={H}", 2 * t * H * 2, get, rms_norm, reference.rms_norm,
         lambda o: o)
    get2 = b.rotating(lambda: (torch.randn(t, H, device=DEV, dtype=DT),
                               torch.randn(t, H, device=DEV, dtype=DT), w, 1e-5), 2 * t * H * 2)
    # Out of place first for the error: the fast op writes into its inputs.
    args = get2()
    want = reference.fused_add_rms_norm(*args)[0]
    err = rel_err(fused_add_rms_norm(args[0].clone(), args[1].clone(), w, 1e-5)[0], want)
    b.record("fused_add_rms_norm", f"T={t} H={H}", 4 * t * H * 2,
             time_ms(lambda: fused_add_rms_norm(*get2())),
             time_ms(lambda: reference.fused_add_rms_norm(*get2())), err)


def bench_silu(b: Bench, t: int) -> None:
    get = b.rotating(lambda: (torch.randn(t, 2 * INTER, device=DEV, dtype=DT),), t * INTER * 4)
    pair(b, "silu_and_mul", f"T={t} I={INTER}", 3 * t * INTER * 2, get, silu_and_mul,
         reference.silu_and_mul, lambda o: o)


def bench_rope_cache(b: Bench, t: int) -> None:
    cs = torch.randn(8192, D, device=DEV)
    blocks = t // 16 + 4
    kc = torch.randn(blocks, 16, HKV, D, device=DEV, dtype=DT)
    vc = torch.randn_like(kc)

    def make() -> tuple[Any, ...]:
        qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=DEV, dtype=DT)
        q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=1)
        return (q.view(t, HQ, D), k.view(t, HKV, D), v.view(t, HKV, D),
                torch.randint(0, 8192, (t,), device=DEV), cs, kc, vc,
                torch.randperm(blocks * 16, device=DEV)[:t])

    get = b.rotating(make, t * (HQ + 2 * HKV) * D * 2)
    # Read q, k, v and cos/sin; write q_rot, k_rot and the cache's k and v.
    nbytes = t * D * 2 * ((HQ + 2 * HKV) + (HQ + HKV) + 2 * HKV) + t * D * 4
    pair(b, "rotary_and_cache_write", f"T={t} {HQ}/{HKV}x{D}", nbytes, get,
         rotary_and_cache_write, reference.rotary_and_cache_write, lambda o: o[0])


def bench_attention(b: Bench, name: str, qlens: list[int], slens: list[int],
                    with_ref: bool) -> None:
    q, kc, vc, meta = make_batch(qlens, slens, num_kv_heads=HKV, group=HQ // HKV, head_dim=D,
                                 block_size=16, dtype=DT, device=DEV)
    nbytes = sum(slens) * HKV * D * 2 * 2 + 2 * q.numel() * 2  # K/V once, q in, out
    flops = sum(4 * ql * (sl - ql / 2) * HQ * D for ql, sl in zip(qlens, slens))
    scale = D ** -0.5
    fast = lambda: pa.paged_attention(q, kc, vc, meta, scale)
    ref = lambda: reference.paged_attention(q, kc, vc, meta, scale)
    cfg = pa.choose_config(meta, HKV, HQ // HKV, D, q.device, q.dtype)
    # One cache per case (usually larger than L2 already); do_bench flushes L2 per call.
    b.record("paged_attention", f"{name} (splits {cfg.num_splits})", nbytes, time_ms(fast),
             time_ms(ref) if with_ref else None, rel_err(fast(), ref()), flops=flops)


def bench_linear(b: Bench, m: int, name: str, k: int, n: int, sweep: bool) -> None:
    """cuBLAS vs the default Triton GEMV config; with sweep, every candidate config too."""
    wbytes = n * k * 2
    get = b.rotating(lambda: (torch.randn(m, k, device=DEV, dtype=DT),
                              torch.randn(n, k, device=DEV, dtype=DT) * 0.02), wbytes)
    nbytes = wbytes + m * (k + n) * 2
    shape = f"{name} M={m} K={k} N={n}"
    x, w = get()
    want = F.linear(x, w)
    cublas = time_ms(lambda: F.linear(*get()))
    b.record("linear", shape, nbytes, cublas, impl="cuBLAS")
    b.record("linear", shape, nbytes, time_ms(lambda: gemv.gemv(*get())), cublas,
             rel_err(gemv.gemv(x, w), want), impl="triton default")
    if not sweep:
        return
    best: tuple[float, gemv.GemvConfig | None] = (math.inf, None)
    for cfg in gemv.candidate_configs(m, n, k):
        ms = time_ms(lambda cfg=cfg: gemv.gemv(*get(), None, cfg))
        b.record("gemv_candidate", shape, nbytes, ms, cublas,
                 rel_err(gemv.gemv(x, w, None, cfg), want), impl=repr(cfg))
        best = min(best, (ms, cfg), key=lambda r: r[0])
    b.record("linear", shape, nbytes, best[0], cublas, impl="triton best", config=repr(best[1]))


def _gemm_step(layers: list[dict[str, torch.Tensor]], lm_head: torch.Tensor, x_h: torch.Tensor,
               x_i: torch.Tensor, impl: str) -> torch.Tensor:
    for lw in layers:
        for nm in ("qkv", "o", "gate_up"):
            triton_ops.linear(x_h, lw[nm], impl=impl)
        triton_ops.linear(x_i, lw["down"], impl=impl)
    return triton_ops.linear(x_h, lm_head, impl=impl)


def bench_decode_step(b: Bench) -> dict[str, Any]:
    """GEMM-only batch-1 decode step (32 x qkv/o/gate_up/down + lm_head) replayed as a graph."""
    layers = [{nm: torch.randn(n, k, device=DEV, dtype=DT) * 0.02
               for nm, (k, n) in GEMV_SHAPES.items() if nm != "lm_head"} for _ in range(LAYERS)]
    lm_head = torch.randn(VOCAB, H, device=DEV, dtype=DT) * 0.02
    wbytes = sum(w.numel() * 2 for lw in layers for w in lw.values()) + lm_head.numel() * 2
    x_h = torch.randn(1, H, device=DEV, dtype=DT)
    x_i = torch.randn(1, INTER, device=DEV, dtype=DT)
    result: dict[str, Any] = {"weight_bytes": wbytes, "bound_ms": wbytes / b.copy_gbps / 1e6}
    for impl, label in (("torch", "cuBLAS"), ("auto", "linear(auto)")):
        _gemm_step(layers, lm_head, x_h, x_i, impl)  # measures the per-shape choices first
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _gemm_step(layers, lm_head, x_h, x_i, impl)
        ms = time_ms(graph.replay)
        result[label] = {"ms": ms, "tok_s": 1e3 / ms, "pct_bound": 100 * result["bound_ms"] / ms}
        b.record("decode_step_gemms", f"Llama-8B M=1, CUDA graph ({label})", wbytes, ms,
                 impl=label)
    return result


def print_table(b: Bench, step: dict[str, Any] | None) -> None:
    print(f"\n{torch.cuda.get_device_name()}: copy {b.copy_gbps:.0f} GB/s (read + write), "
          f"L2 {b.l2 >> 20} MiB; 'x ref' = reference (torch / cuBLAS) time / this time\n")
    print(f"{'kernel':22s} {'shape':40s} {'impl':14s} {'us':>9s} {'ref us':>9s} {'x ref':>6s} "
          f"{'GB/s':>6s} {'%copy':>6s} {'TF/s':>6s} {'rel err':>8s}")
    dash = lambda width: f"{'-':>{width}s}"
    for r in b.rows:
        if r["kernel"] == "gemv_candidate":
            continue
        ref = f"{r['ref_ms'] * 1e3:9.1f}" if r["ref_ms"] else dash(9)
        sp = f"{r['speedup']:6.2f}" if r["speedup"] else dash(6)
        tf = f"{r['tflops']:6.1f}" if r["tflops"] else dash(6)
        er = f"{r['rel_err']:8.1e}" if r["rel_err"] is not None else dash(8)
        print(f"{r['kernel'][:22]:22s} {r['shape'][:40]:40s} {r['impl'][:14]:14s} "
              f"{r['ms'] * 1e3:9.1f} {ref} {sp} {r['gbps']:6.0f} {r['pct_copy']:6.1f} {tf} {er}")
    if step:
        print(f"\ndecode-step GEMMs (M=1, graph): bound {step['bound_ms']:.2f} ms; " + "; ".join(
            f"{k} {v['ms']:.2f} ms = {v['pct_bound']:.0f}% of bound"
            for k, v in step.items() if isinstance(v, dict)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer shapes, no GEMV config sweep")
    ap.add_argument("--skip-step", action="store_true", help="skip the 16 GB decode-step test")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "bench_kernels needs a CUDA GPU"
    torch.manual_seed(0)
    t0 = time.time()
    b = Bench()
    for t in [1, 256] if args.quick else [1, 256, 4096]:
        bench_norms(b, t)
        bench_silu(b, t)
        bench_rope_cache(b, t)
    for name, qlens, slens in ATTN_CASES[:2] + ATTN_CASES[5:6] if args.quick else ATTN_CASES:
        bench_attention(b, name, qlens, slens, with_ref=True)
    for m in [1] if args.quick else [1, 4, 16]:
        for name, (k, n) in GEMV_SHAPES.items():
            bench_linear(b, m, name, k, n, sweep=not args.quick and m in (1, 16))
    step = None if args.skip_step else bench_decode_step(b)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "copy_gbps": b.copy_gbps, "l2_bytes": b.l2,
              "dtype": "bfloat16", "rows": b.rows, "decode_step": step,
              "linear_choices": triton_ops.linear_choices(), "wall_s": time.time() - t0}
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(result, indent=1, default=str))
    print_table(b, step)
    print(f"wall {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
