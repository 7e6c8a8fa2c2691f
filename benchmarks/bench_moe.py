"""The MoE layer alone: the fused Triton kernels against a per-expert loop of torch matmuls.

For each layer shape (Qwen3-30B-A3B bf16 and int4, Mixtral-8x7B bf16, fp8 and int4 experts; int4:
groups of 128 along K, a float16 scale and a uint8 zero each) and 1 / 64 / 512
tokens: routing plus experts through kernels/moe/fused_moe.py, replayed in a CUDA graph over 16
different routings (so the experts a call reads are not the previous call's, still in L2), and
the loop (one F.linear pair per expert that got tokens, as transformers does, timed eagerly:
it reads the routing back to pick the experts). Also the bytes the call must read (the experts
it hits, at their width) and, for the graph-timed kernels, the percent of the copy-bandwidth
bound for those bytes. --sweep times the decode GEMV tiles at one token.

  python benchmarks/bench_moe.py [--shapes qwen3-30b-a3b,mixtral-8x7b-fp8,qwen3-30b-a3b-int4]
      [--tokens 1,64,512]
      [--sweep] [--output-json $OUT/moe_layer.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from slipstream.bench.latency import measure_copy_bandwidth
from slipstream.kernels.moe import fused_moe as fm
from slipstream.kernels.moe.reference import Int4Experts, dequantize_experts
from slipstream.kernels.runtime.tuning import graph_time_us
from slipstream.quantization.utils import (
    pack_int4_rows,
    quantize_fp8_per_channel,
    quantize_int4_groupwise,
)

# name -> (experts, top_k, hidden, expert intermediate, renormalize, expert format)
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, True, None),
    "qwen3-30b-a3b-int4": (128, 8, 2048, 768, True, "int4"),
    "mixtral-8x7b": (8, 2, 4096, 14336, True, None),
    "mixtral-8x7b-fp8": (8, 2, 4096, 14336, True, "fp8"),
    "mixtral-8x7b-int4": (8, 2, 4096, 14336, True, "int4"),
}
ROUTINGS = 16
INT4_GROUP = 128


def make_layer(experts: int, hidden: int, inter: int, fmt: str | None):
    """Random bf16 (or fp8 with per-row scales, or int4 in groups) stacked expert weights on
    the GPU: (w13, w2, s13, s2, Int4Experts or None)."""
    w13 = torch.empty(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
    w2 = torch.empty(experts, hidden, inter, device="cuda", dtype=torch.bfloat16)
    w13.normal_(0, 0.02)
    w2.normal_(0, 0.02)
    if fmt is None:
        return w13, w2, None, None, None
    if fmt == "int4":
        out = []
        for w in (w13, w2):
            q, scale, zero = quantize_int4_groupwise(w.view(-1, w.shape[2]), INT4_GROUP)
            out.append((pack_int4_rows(q).view(experts, w.shape[1], -1),
                        scale.half().view(experts, w.shape[1], -1),
                        zero.view(experts, w.shape[1], -1)))
        (q13, s13, z13), (q2, s2, z2) = out
        return q13, q2, s13, s2, Int4Experts(z13, z2, INT4_GROUP)
    q13, s13 = quantize_fp8_per_channel(w13.view(-1, hidden))
    del w13
    q2, s2 = quantize_fp8_per_channel(w2.view(-1, inter))
    return (q13.view(experts, 2 * inter, hidden), q2.view(experts, hidden, inter),
            s13.view(experts, -1), s2.view(experts, -1), None)


def _expert_weight(w, scale, zero, group, e, dtype):
    if zero is not None:
        return dequantize_experts(w[e], scale[e], dtype, zero[e], group)
    return w[e] if scale is None else (w[e].to(dtype) * scale[e, :, None].to(dtype))


def loop_moe(x, w13, w2, weights, ids, s13, s2, int4=None):
    """The baseline: one torch matmul pair per expert that received tokens."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.view(-1).long()
    top_k = ids.shape[1]
    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().squeeze(1)
        tokens = pairs // top_k
        z13, z2, group = (int4.w13_zero, int4.w2_zero, int4.group_size) if int4 else (None,) * 3
        a = _expert_weight(w13, s13, z13, group, e, x.dtype)
        b = _expert_weight(w2, s2, z2, group, e, x.dtype)
        gate, up = F.linear(x[tokens], a).chunk(2, dim=-1)
        down = F.linear(F.silu(gate) * up, b)
        out.index_add_(0, tokens, down.float() * weights.view(-1)[pairs, None])
    return out.to(x.dtype)


def eager_us(call, arg_sets, repeats: int = 5) -> float:
    for args in arg_sets[:2]:
        call(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for args in arg_sets:
            call(*args)
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / len(arg_sets))
    return statistics.median(times)


def bytes_read(ids: torch.Tensor, w13, w2, s13, s2, int4=None) -> int:
    """Bytes of the experts one call hits (weights plus their scales and zeros)."""
    hit = len(set(ids.view(-1).tolist()))
    extra = [] if s13 is None else [s13, s2]
    if int4 is not None:
        extra += [int4.w13_zero, int4.w2_zero]
    return hit * sum(t[0].numel() * t.element_size() for t in [w13, w2, *extra])


def bench_shape(name: str, tokens: list[int], bandwidth: float | None, sweep: bool) -> list[dict]:
    experts, top_k, hidden, inter, renorm, fmt = SHAPES[name]
    w13, w2, s13, s2, int4 = make_layer(experts, hidden, inter, fmt)
    rows = []
    for t in tokens:
        gen = torch.Generator(device="cuda").manual_seed(t)
        sets = [(torch.randn(t, hidden, device="cuda", generator=gen).to(torch.bfloat16),
                 torch.randn(t, experts, device="cuda", generator=gen))
                for _ in range(ROUTINGS)]
        routed = [(x, *fm.route_topk(logits, top_k, renorm)) for x, logits in sets]

        def fused(args, _cfg=None):
            x, logits = args
            weights, ids = fm.route_topk(logits, top_k, renorm)
            return fm.fused_moe(x, w13, w2, weights, ids, s13, s2, int4, gemv=_cfg)

        kernel_us = graph_time_us(fused, sets, min_calls=ROUTINGS)
        loop_us = eager_us(lambda x, w, i: loop_moe(x, w13, w2, w, i, s13, s2, int4), routed)
        nbytes = statistics.mean(bytes_read(i, w13, w2, s13, s2, int4) for _, _, i in routed)
        x, weights, ids = routed[0]
        want = loop_moe(x.float(), w13.float() if s13 is None else w13,
                        w2.float() if s2 is None else w2, weights, ids, s13, s2, int4)
        got = fm.fused_moe(x, w13, w2, weights, ids, s13, s2, int4).float()
        row = {"shape": name, "tokens": t,
               "path": "decode" if fm.use_decode_path(t, top_k, experts) else "grouped",
               "fused_us": kernel_us, "loop_us": loop_us, "speedup": loop_us / kernel_us,
               "mb_read": nbytes / 1e6, "rel_err": ((got - want).norm() / want.norm()).item()}
        if bandwidth:
            row["pct_bound"] = 100 * (nbytes / bandwidth * 1e6) / kernel_us
        if sweep and t == 1:
            row["sweep"] = {}
            for bn in (4, 8, 16, 32):
                for k_bytes in (256, 512, 1024):
                    for warps in (2, 4, 8):
                        # int4: k_bytes of packed weight hold twice as many columns
                        per_byte = 2 if int4 is not None else 1 / w13.element_size()
                        cfg = fm.GemvConfig(bn, int(k_bytes * per_byte), warps)
                        us = graph_time_us(lambda a, c=cfg: fused(a, c), sets, min_calls=ROUTINGS)
                        row["sweep"][f"n{bn}-k{cfg.block_k}-w{warps}"] = us
            best = min(row["sweep"], key=row["sweep"].get)
            row["sweep_best"] = (best, row["sweep"][best])
        rows.append(row)
        print(f"{name:<18}{t:>6}  {row['path']:<8}{kernel_us:>10.1f}{loop_us:>10.1f}"
              f"{row['speedup']:>8.2f}{row['mb_read']:>9.1f}"
              f"{row.get('pct_bound', float('nan')):>8.1f}{row['rel_err']:>10.2e}"
              + (f"  best tile {row['sweep_best'][0]}: {row['sweep_best'][1]:.1f} us"
                 if "sweep_best" in row else ""), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b-fp8,mixtral-8x7b")
    parser.add_argument("--tokens", default="1,64,512")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    bandwidth = measure_copy_bandwidth("cuda")
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s on {torch.cuda.get_device_name()}")
    print(f"{'shape':<18}{'tokens':>6}  {'path':<8}{'fused us':>10}{'loop us':>10}{'x loop':>8}"
          f"{'MB read':>9}{'% bound':>8}{'rel err':>10}")
    rows = []
    for name in args.shapes.split(","):
        rows += bench_shape(name, [int(t) for t in args.tokens.split(",")], bandwidth,
                            args.sweep)
        torch.cuda.empty_cache()  # the shape's weights are gone with its frame
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth, "rows": rows},
            indent=2))


if __name__ == "__main__":
    main()
