"""Where a batch-1 decode step's GPU time goes, measured in context, without a profiler.

The model's forward (every layer and the LM head) for one sequence at a given context is
captured in a CUDA graph as the engine replays it (PDL on), timed over many replays, then
captured and timed again with one kind of kernel taken out: attention (the layer returns q), the
RMSNorms (the layer passes its input through), both, or one projection of every layer (no_qkv,
no_o, no_gate_up, no_down: its output is left unwritten, a norm fused with it still runs) or the
LM head (no_head). The difference is that part's cost on
the critical path, each kernel's overlap with its neighbours included, which the profiler's
per-kernel spans cannot show. The outputs of the reduced graphs are meaningless; only time counts.

    python benchmarks/bench_step_parts.py --quantization fp8 --quantize-lm-head --ctx 256 \
        [--output-json F]
    python benchmarks/bench_step_parts.py --attn-variants _MIN_TOKENS_PER_SPLIT=128,_SPLIT_WARPS=4

--attn-variants times the whole step again under each setting of kernels/attention/paged.py's
module knobs (`+` joins several; integers, 0 / 1 for flags), in the same process and graphs'
shapes: an A/B of the attention choices without reloading or retuning the model.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

import torch

from slipstream.attention.backend import AttentionMetadata
from slipstream.bench.shapes import is_shape_name, resolve_model
from slipstream.engine.args import EngineArgs
from slipstream.kernels.attention import paged as paged_attention
from slipstream.kernels.attention.l2_spans import budget_bytes
from slipstream.layers.attention import Attention
from slipstream.layers.norm import RMSNorm
from slipstream.runner.model_runner import ModelRunner

PARTS = ("full", "no_attention", "no_norms", "no_attention_norms", "no_qkv", "no_o", "no_gate_up",
         "no_down", "no_head")
_PROJECTIONS = {"no_qkv": "qkv_proj", "no_o": "o_proj", "no_gate_up": "gate_up_proj",
                "no_down": "down_proj"}


def _skip_attention(self, q, k, v, positions, cos_sin_cache, kv_cache, meta):
    return q


def _skip_norm(self, x, residual=None):
    return x if residual is None else (x, residual)


def _skipped_linear(layer) -> dict:
    """Instance methods that launch nothing: outputs of the right shape, left unwritten
    (torch.empty: no kernel, from the graph's pool), residual adds dropped."""
    n = layer.output_size

    def out(x, width=n):
        return torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)

    def normed(x, residual, norm):
        h, residual = (norm(x), x) if residual is None else norm(x, residual)
        return out(h), residual

    return {"forward": out, "forward_rms": lambda x, eps: out(x),
            "forward_normed": normed, "forward_gate_out": lambda x, rms_eps=0.0: out(x, n // 2),
            "forward_residual": lambda x, residual: residual,
            "forward_gated": lambda gate_up, act: out(gate_up)}


@contextlib.contextmanager
def without(part: str, model: torch.nn.Module | None = None):
    """The model with `part`'s kernels taken out (patches restored after); the projection and
    head parts patch `model`'s modules."""
    if model is None and (part in _PROJECTIONS or part == "no_head"):
        raise ValueError(f"part {part!r} needs the model")
    saved = Attention.forward, RMSNorm.forward
    if "attention" in part:
        Attention.forward = _skip_attention
    if "norms" in part:
        RMSNorm.forward = _skip_norm
    patched = []
    suffix = _PROJECTIONS.get(part)
    for name, module in model.named_modules() if suffix is not None else ():
        if name.endswith(suffix):
            patched.append(module)
            for attr, fn in _skipped_linear(module).items():
                setattr(module, attr, fn)
    if part == "no_head":
        patched.append(model)
        model.compute_logits = lambda hidden, float32=True: torch.empty(
            (hidden.shape[0], model.config.vocab_size), dtype=hidden.dtype, device=hidden.device)
    try:
        yield
    finally:
        Attention.forward, RMSNorm.forward = saved
        for module in patched:  # instance attributes shadow the class's methods: drop them
            for attr in [a for a in vars(module) if a.startswith(("forward", "compute_logits"))]:
                delattr(module, attr)


@contextlib.contextmanager
def attention_knobs(variant: str):
    """paged_attention's module knobs set as `variant` says (NAME=INT[+NAME=INT...])."""
    settings = {}
    for item in variant.split("+"):
        name, _, value = item.partition("=")
        if not hasattr(paged_attention, name) or not value.lstrip("-").isdigit():
            raise SystemExit(f"--attn-variants: {item!r} is not NAME=INT of a paged_attention knob")
        kind = type(getattr(paged_attention, name))
        settings[name] = kind(int(value))
    saved = {name: getattr(paged_attention, name) for name in settings}
    for name, value in settings.items():
        setattr(paged_attention, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(paged_attention, name, value)


def part_bytes(model: torch.nn.Module, part: str) -> int:
    """Bytes of the weights (and their scales) a projection part or the head reads a step:
    its saved time against them is its in-context read rate."""
    suffix = _PROJECTIONS.get(part, "lm_head" if part == "no_head" else None)
    if suffix is None:
        return 0
    return sum(t.numel() * t.element_size()
               for name, module in model.named_modules() if name.endswith(suffix)
               for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)])


def decode_inputs(runner: ModelRunner, ctx: int, max_seq_len: int):
    """One sequence decoding its token at position ctx - 1 over blocks 0, 1, ..."""
    dev, bs = runner.device, runner.block_size
    blocks = torch.arange((ctx + bs - 1) // bs, dtype=torch.int32, device=dev)[None, :]
    pos = ctx - 1
    meta = AttentionMetadata(
        num_seqs=1, num_tokens=1, query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([ctx], dtype=torch.int32, device=dev), block_tables=blocks,
        slot_mapping=torch.tensor([pos], dtype=torch.int64, device=dev),
        max_query_len=1, max_seq_len=max_seq_len)
    ids = torch.tensor([11], dtype=torch.int64, device=dev)
    return ids, torch.tensor([pos], dtype=torch.int64, device=dev), meta


def time_part(runner: ModelRunner, inputs, graph: bool, replays: int) -> float:
    """Median us per forward (+ logits) over `replays`, from a captured graph (or eager)."""
    model = runner.model

    def forward():
        ids, positions, meta = inputs
        return model.compute_logits(model(ids, positions, runner.kv_caches, meta), False)

    with torch.inference_mode():
        for _ in range(2):  # tuning and compilation happen here, outside the capture
            forward()
        run = forward
        if graph:
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                forward()
            run = g.replay
        times = []
        for _ in range(5):
            if runner.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(replays):
                    run()
                end.record()
                end.synchronize()
                times.append(1e3 * start.elapsed_time(end) / replays)
            else:
                import time
                t0 = time.perf_counter()
                for _ in range(replays):
                    run()
                times.append(1e6 * (time.perf_counter() - t0) / replays)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--quantization", default=None)
    p.add_argument("--quantize-lm-head", nargs="?", const=True, default=None,
                   help="the head quantized too (a format: int8, int4, fp8)")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--ctx", type=int, default=256, help="context of the decoded token")
    p.add_argument("--max-model-len", type=int, default=384, help="the graphs' split choice")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--attn-variants", default="",
                   help="comma list of NAME=INT[+NAME=INT] paged_attention knob settings")
    p.add_argument("--l2-budgets", default="",
                   help="comma list of L2 prefetch budgets in MB (kernels/attention/l2_spans.py), each "
                        "timed as a whole step, MB:gate_up for gate/up alone (default o+gate_up); "
                        "the parts use the engine's default budget")
    p.add_argument("--replays", type=int, default=100)
    p.add_argument("--device", default="cuda")
    p.add_argument("--load-format", default=None, help="default: dummy for a shape name")
    p.add_argument("--output-json", default=None)
    ns = p.parse_args()
    if not 0 < ns.ctx <= ns.max_model_len:  # the KV cache holds max_model_len tokens
        raise SystemExit(f"--ctx {ns.ctx} must be in 1..--max-model-len ({ns.max_model_len})")
    model_dir, _ = resolve_model(ns.model)
    load_format = ns.load_format or ("dummy" if is_shape_name(ns.model) else "auto")
    config = EngineArgs(model=model_dir, load_format=load_format, dtype="bfloat16",
                        device=ns.device, quantization=ns.quantization,
                        quantize_lm_head=ns.quantize_lm_head, kv_cache_dtype=ns.kv_cache_dtype,
                        max_num_seqs=1, max_model_len=ns.max_model_len).create_engine_config()
    runner = ModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(ns.max_model_len // runner.block_size + 2)
    inputs = decode_inputs(runner, ns.ctx, ns.max_model_len)
    budget = budget_bytes(runner.device)
    runner.model.attach_l2_prefetch(budget)  # as ModelRunner.capture_cuda_graphs does
    rows = []
    for part in ns.parts.split(","):
        if part not in PARTS:
            raise SystemExit(f"unknown part {part!r}; choose from {', '.join(PARTS)}")
        with without(part, runner.model):
            us = time_part(runner, inputs, runner.device.type == "cuda", ns.replays)
        rows.append({"part": part, "us_per_step": us, "bytes": part_bytes(runner.model, part)})
    for variant in filter(None, ns.attn_variants.split(",")):
        with attention_knobs(variant):
            us = time_part(runner, inputs, runner.device.type == "cuda", ns.replays)
        rows.append({"part": f"full {variant}", "us_per_step": us})
        print(f"measured {variant}: {us:.1f} us/step", flush=True)  # survives a timeout
    for item in filter(None, ns.l2_budgets.split(",")):
        mb, _, targets = item.partition(":")  # "16" or "16:gate_up" (targets joined by +)
        per_layer = runner.model.attach_l2_prefetch(
            int(float(mb) * 2**20), tuple(targets.split("+")) if targets else ("o", "gate_up"))
        us = time_part(runner, inputs, runner.device.type == "cuda", ns.replays)
        rows.append({"part": f"full l2_prefetch={item}", "us_per_step": us,
                     "prefetched_bytes_per_layer": per_layer})
        print(f"measured L2 prefetch {item} ({per_layer / 2**20:.1f} MiB a layer): "
              f"{us:.1f} us/step", flush=True)
    runner.model.attach_l2_prefetch(budget)
    if (ns.attn_variants or ns.l2_budgets) and "full" in ns.parts.split(","):  # drift check
        rows.append({"part": "full (again)",
                     "us_per_step": time_part(runner, inputs, runner.device.type == "cuda",
                                              ns.replays)})
    full = next((r["us_per_step"] for r in rows if r["part"] == "full"), None)
    print(f"{'part':<44} {'us/step':>9} {'saved':>9} {'MB':>8} {'GB/s':>7}")
    for r in rows:
        saved = None if full is None else full - r["us_per_step"]
        mb = r.get("bytes", 0) / 1e6
        rate = f"{r['bytes'] / saved / 1e3:7.0f}" if mb and saved and saved > 0 else ""
        print(f"{r['part']:<44} {r['us_per_step']:9.1f} "
              f"{'' if saved is None else f'{saved:9.1f}'} {f'{mb:8.1f}' if mb else '':>8} {rate}")
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(
            {"model": ns.model, "quantization": ns.quantization, "ctx": ns.ctx,
             "quantize_lm_head": ns.quantize_lm_head, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
