"""Decode attention on one GPU: achieved KV-read bandwidth per batch shape and tile config.

    python benchmarks/bench_attention.py --output-json $OUT/attn.json [--sweep] [--cases 512x1000]
        [--kv bf16,fp8,int8] [--pages 16,64] [--layouts token,head]
For each decode case (batch x context, Llama-3.1-8B heads, page 16 unless --pages, each cache
layout of --layouts) times the default config (choose_config), without splits also the
heads-first grid, for split launches also the staged tile loops alone (no one-stage loop for
short splits: 3 stages, and 1 stage), and, with --sweep, a grid of tile configs; prints GB/s
against a device copy measured in the same run. Each call is timed as a CUDA-graph replay (a
batch-1 launch from Python costs more than the kernel).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import torch
import triton.testing

from slipstream.bench.attn_batch import make_batch
from slipstream.kernels.attention import paged as pa

HQ, HKV, D = 32, 8, 128
_KV_TYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
CASES = [(512, 192), (512, 1000), (256, 512), (64, 1024), (8, 4096), (1, 1024), (1, 8192)]


def time_ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=60, return_mode="median")


def copy_gbps() -> float:
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / time_ms(lambda: dst.copy_(src)) / 1e6


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values stored [blocks, heads, page, D] (each head's page rows contiguous), seen
    through the kernels' [blocks, page, heads, D] strides."""
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def run_case(batch: int, ctx: int, kv_dtype: torch.dtype, sweep: bool, page: int = 16,
             layout: str = "token") -> list[dict]:
    q, kc, vc, meta = make_batch([1] * batch, [ctx] * batch, num_kv_heads=HKV, group=HQ // HKV,
                                 head_dim=D, block_size=page, dtype=torch.bfloat16, device="cuda")
    scales = {}
    if kv_dtype != torch.bfloat16:
        kc, vc = kc.to(kv_dtype), vc.to(kv_dtype)
        one = torch.ones(1, device="cuda", dtype=torch.float32)
        scales = dict(k_scale=one, v_scale=one)
    if layout == "head":
        kc, vc = head_major(kc), head_major(vc)
    nbytes = batch * ctx * HKV * D * 2 * kc.element_size()
    base = pa.choose_config(meta, HKV, HQ // HKV, D, q.device, q.dtype, kc.dtype)
    configs = [("default", base)]
    if base.short_chain:  # split decode: the staged loops alone, with cp.async stages or none
        configs.append(("staged", dataclasses.replace(base, short_chain=0)))
        configs.append(("plain s1", dataclasses.replace(base, short_chain=0, num_stages=1)))
    if base.num_splits == 1:  # the KV-head axis of the grid first
        configs.append(("heads first", dataclasses.replace(base, heads_first=True)))
    if batch == 1:  # a decode graph captured for a long max_model_len keeps ~2 programs per SM
        configs.append(("graph", dataclasses.replace(base, num_splits=33)))
        configs.append(("graph staged", dataclasses.replace(base, num_splits=33, short_chain=0)))
        configs.append(("graph plain s1", dataclasses.replace(base, num_splits=33, short_chain=0,
                                                              num_stages=1)))
    if sweep:
        for bn, st, w in itertools.product((32, 64, 128), (1, 2, 3, 4), (2, 4, 8)):
            configs.append(("sweep", pa.AttnConfig(base.block_m, bn, base.num_splits, w, st)))
    rows = []
    expect = pa.paged_attention(q, kc, vc, meta, D ** -0.5, **scales)
    for tag, cfg in configs:
        fn = lambda cfg=cfg: pa.paged_attention(q, kc, vc, meta, D ** -0.5, config=cfg, **scales)
        try:
            if not torch.allclose(fn().float(), expect.float(), atol=2e-2, rtol=2e-2):
                print(f"  mismatch {cfg}")
                continue
            ms = time_ms(fn)
        except Exception as e:  # e.g. out of shared memory
            print(f"  skip {cfg}: {type(e).__name__}")
            continue
        rows.append(dict(batch=batch, ctx=ctx, kv=str(kv_dtype), page=page, layout=layout,
                         tag=tag, config=str(cfg),
                         us=ms * 1e3, gbps=nbytes / ms / 1e6))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cases", default=None, help="e.g. 512x1000,512x192 (default: all)")
    ap.add_argument("--kv", default="bf16,fp8,int8", help="cache dtypes to time")
    ap.add_argument("--pages", default="16", help="KV page sizes to time, e.g. 16,64")
    ap.add_argument("--layouts", default="token",
                    help="cache layouts: token ([blocks, page, heads, D], the engine's), head "
                         "([blocks, heads, page, D] under the same strides)")
    args = ap.parse_args()
    cases = CASES if not args.cases else [tuple(map(int, c.split("x"))) for c in args.cases.split(",")]
    kv_types = [_KV_TYPES[k] for k in args.kv.split(",")]
    t0 = time.time()
    bw = copy_gbps()
    rows = []
    layouts = [(int(p), lay) for p in args.pages.split(",") for lay in args.layouts.split(",")]
    for (batch, ctx), kv, (page, layout) in itertools.product(cases, kv_types, layouts):
        if kv != torch.bfloat16 and batch < 256:
            continue
        case = run_case(batch, ctx, kv, args.sweep, page, layout)
        rows += case
        best = min(case, key=lambda r: r["us"])
        default = next((r for r in case if r["tag"] == "default"), best)
        print(f"B={batch:<4} ctx={ctx:<5} kv={str(kv)[6:]:<14} page={page:<3} {layout:<5} "
              f"default {default['us']:7.1f} us "
              f"({100 * default['gbps'] / bw:4.1f}%)  best {best['us']:7.1f} us "
              f"({100 * best['gbps'] / bw:4.1f}%) {best['config']}", flush=True)
        for r in case:
            if r["tag"] != "default" and r["tag"] != "sweep":
                print(f"    {r['tag']:<15} {r['us']:7.1f} us  {r['config']}", flush=True)
    result = dict(device=torch.cuda.get_device_name(), copy_gbps=bw, rows=rows,
                  wall_s=time.time() - t0)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    print(f"copy {bw:.0f} GB/s; wall {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
