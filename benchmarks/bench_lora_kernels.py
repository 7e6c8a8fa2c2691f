"""The LoRA kernels of one decode forward: before and after the shared shrink workspace.

    python benchmarks/bench_lora_kernels.py [--tokens 1 4 16 64 512] [--adapters 8]

Llama-3.1-8B shapes, bf16, rank 16 on qkv, o, gate_up and down of 32 layers, 16 device slots,
the batch's rows spread over `--adapters` slots. For each token count it captures three CUDA
graphs of the 128 projections of a forward and times their replay (as the engine's decode
graphs do):

- base: the base products alone (the engine's linear kernels; gate/up then SiLU-and-mul, one
  kernel at one row);
- base + LoRA before: memset + shrink + expand per projection (K split at 64 rows or fewer),
  SiLU-and-mul apart;
- base + LoRA after: what the engine runs: one workspace zeroed once a forward, then
  `lora_add` (shrink into the projection's columns of it + expand) per projection,
  SiLU-and-mul apart.

Prints microseconds per forward and the LoRA overhead over the base products.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch

from slipstream.kernels.lora import triton_lora
from slipstream.kernels.lora.meta import meta_views, pack_meta
from slipstream.kernels.norm_act.activation import silu_and_mul
from slipstream.quantization.base import linear_kernels

LAYERS, SLOTS, RANK = 32, 16, 16
DEV = "cuda"
# projection -> (K, shard sizes)
SHAPES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
          "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}


def _previous(x, y, a, b, meta, shards):
    """Memset + shrink + expand: a zeroed h of its own per projection, K split only at 64 rows
    or fewer."""
    k = x.shape[1]
    split = max(1, min(16, k // 256)) if x.shape[0] <= 64 else 1
    h = triton_lora.lora_shrink(x, a, meta, split=split)
    return triton_lora.lora_expand(y, h, b, meta, shards)


def _layers(dev: str) -> list[dict]:
    out = []
    for _ in range(LAYERS):
        layer = {}
        for name, (k, sizes) in SHAPES.items():
            n = sum(sizes)
            layer[name] = dict(
                w=torch.empty(n, k, device=dev, dtype=torch.bfloat16).normal_(0, 0.02),
                a=torch.empty(SLOTS, len(sizes) * RANK, k, device=dev,
                              dtype=torch.bfloat16).normal_(0, 0.02),
                b=torch.empty(SLOTS, n, RANK, device=dev, dtype=torch.bfloat16).normal_(0, 0.02),
                shards=tuple(sum(sizes[:j]) for j in range(len(sizes))))
        out.append(layer)
    return out


def _graph_us(fn: Callable[[], None], iters: int = 20) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def run(tokens: int, adapters: int, layers: list[dict]) -> tuple[float, float, float]:
    dev = DEV
    slots = np.arange(tokens, dtype=np.int32) % max(1, min(adapters, SLOTS))
    packed = torch.from_numpy(pack_meta(slots, SLOTS)).to(dev)
    meta = meta_views(packed, tokens, SLOTS)
    ops = linear_kernels()
    xs = {name: torch.randn(tokens, k, device=dev, dtype=torch.bfloat16)
          for name, (k, _) in SHAPES.items()}
    # The engine's shrink workspace: a column range per projection, zeroed once a forward.
    widths = {name: len(sizes) * RANK for name, (_, sizes) in SHAPES.items()}
    per_layer = sum(widths.values())
    ws = torch.empty((tokens, per_layer * len(layers)), device=dev, dtype=torch.float32)
    h_of = {}
    col = 0
    for i in range(len(layers)):
        for name in SHAPES:
            h_of[(i, name)] = ws[:, col : col + widths[name]]
            col += widths[name]

    def gate_up(p: dict, mode: str, h) -> None:
        """The MLP's first half as the engine runs it: one row without LoRA is the gate/up
        GEMV writing SiLU-and-mul itself; with LoRA, the product, its delta, SiLU-and-mul."""
        x = xs["gate_up"]
        if mode == "base" and tokens == 1 and getattr(ops, "linear_gate_out", None):
            if ops.linear_gate_out(x, p["w"], None) is not None:
                return
        y = ops.linear(x, p["w"], None)
        if mode == "before":
            _previous(x, y, p["a"], p["b"], meta, p["shards"])
        elif mode == "after":
            triton_lora.lora_add(x, y, p["a"], p["b"], meta, p["shards"], h)
        silu_and_mul(y)

    def forward(mode: str) -> Callable[[], None]:
        def go() -> None:
            if mode == "after":
                ws.zero_()
            for i, layer in enumerate(layers):
                for name, p in layer.items():
                    if name == "gate_up":
                        gate_up(p, mode, h_of[(i, name)])
                        continue
                    y = ops.linear(xs[name], p["w"], None)
                    if mode == "before":
                        _previous(xs[name], y, p["a"], p["b"], meta, p["shards"])
                    elif mode == "after":
                        triton_lora.lora_add(xs[name], y, p["a"], p["b"], meta, p["shards"],
                                             h_of[(i, name)])
        return go

    return _graph_us(forward("base")), _graph_us(forward("before")), _graph_us(forward("after"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    parser.add_argument("--adapters", type=int, default=8)
    args = parser.parse_args()
    layers = _layers(DEV)
    print(f"LoRA kernels of one forward (32 layers x qkv/o/gate_up/down, rank {RANK}, "
          f"{args.adapters} adapters), CUDA graph replay, {torch.cuda.get_device_name()}")
    print(f"{'tokens':>6s} {'base us':>9s} {'+LoRA before':>13s} {'+LoRA after':>12s} "
          f"{'overhead before':>16s} {'after':>7s}")
    for t in args.tokens:
        base, before, after = run(t, args.adapters, layers)
        print(f"{t:6d} {base:9.0f} {before:13.0f} {after:12.0f} "
              f"{(before - base) / base:15.1%} {(after - base) / base:7.1%}")


if __name__ == "__main__":
    main()
