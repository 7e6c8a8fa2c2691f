"""`slipstream bench latency`: a batch of B requests at a time, decode speed and TTFT.

Decode tok/s is output tokens after each request's first, over the time from the first first
token to the last finish. The speed-of-light bound is the device-to-device copy bandwidth
measured in this run (read + write counted) over the bytes one decode step must stream.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from slipstream.bench import report, speculative
from slipstream.bench.datasets import random_requests
from slipstream.bench.shapes import kv_bytes_per_token, load_config, weight_bytes
from slipstream.bench.throughput import (
    build_llm,
    cpu_thread_count,
    engine_kwargs,
    engine_settings,
    model_info,
    peak_memory_gib,
    prepare_model,
    reset_peak_memory,
    resolve_device,
    resolve_dtype,
    run_engine,
)


def measure_copy_bandwidth(device: str, nbytes: int = 2 * 2**30, iters: int = 20) -> float | None:
    """Bytes/s of a large device-to-device copy, read + write counted; None off CUDA."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def speed_of_light(cfg: dict[str, Any], dtype: str, bandwidth: float | None, batch: int,
                   input_len: int, output_len: int, quantization: str | None = None,
                   quantized_lm_head: bool | str | None = False) -> dict[str, Any]:
    """Decode bound in tok/s: B tokens per step, each step streaming every weight once
    (quantized ones at their method's bytes; and, in the second figure, each sequence's K/V at
    its mean decode context, counted at the model dtype)."""
    # An MoE step reads only the experts its tokens are routed to (all experts for dense).
    w_bytes = weight_bytes(cfg, dtype, quantization, quantized_lm_head, decode_batch=batch)
    mean_ctx = input_len + (output_len - 1) / 2
    kv_bytes = batch * mean_ctx * kv_bytes_per_token(cfg, dtype)
    out: dict[str, Any] = {"weight_bytes": w_bytes, "kv_bytes_per_step": kv_bytes,
                           "bound_tok_s": None, "bound_with_kv_tok_s": None}
    if bandwidth:
        out["bound_tok_s"] = batch * bandwidth / w_bytes
        out["bound_with_kv_tok_s"] = batch * bandwidth / (w_bytes + kv_bytes)
    return out


def iteration_stats(outputs: list[Any], wall: float) -> dict[str, float | None]:
    """One generate() call: TTFT (median over the batch), decode tok/s and end-to-end time."""
    metrics = [o.metrics for o in outputs if getattr(o, "metrics", None) is not None]
    firsts = [m.first_token_time for m in metrics if m.first_token_time is not None]
    finishes = [m.finished_time for m in metrics if m.finished_time is not None]
    ttfts = [m.time_to_first_token for m in metrics if m.time_to_first_token is not None]
    decode_tokens = sum(max(len(o.outputs[0].token_ids) - 1, 0) for o in outputs)
    decode_tok_s = None
    if firsts and finishes and max(finishes) > min(firsts):
        decode_tok_s = decode_tokens / (max(finishes) - min(firsts))
    return {"ttft_s": statistics.median(ttfts) if ttfts else None,
            "decode_tok_s": decode_tok_s, "e2e_s": wall,
            "e2e_tok_s": sum(len(o.outputs[0].token_ids) for o in outputs) / wall}


def _rate_stats(values: list[float | None]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"mean": None, "median": None, "min": None, "max": None}
    return {"mean": statistics.fmean(vals), "median": statistics.median(vals),
            "min": min(vals), "max": max(vals)}


def _run_iterations(llm, args: argparse.Namespace, vocab: int,
                    on_outputs=None) -> list[dict[str, Any]]:
    """Warm-up then timed iterations; every iteration gets fresh prompts (no prefix hits)."""
    stats = []
    for it in range(args.num_iters_warmup + args.num_iters):
        reqs = random_requests(args.batch_size, args.input_len, args.output_len, vocab,
                               seed=(args.seed or 0) + 1000 + it)
        outputs, wall = run_engine(llm, reqs)
        if on_outputs is not None:
            on_outputs(outputs)
        if it >= args.num_iters_warmup:
            stats.append(iteration_stats(outputs, wall))
    return stats


def run_latency(args: argparse.Namespace) -> dict[str, Any]:
    """The whole latency benchmark; returns the result dict (also printed / written)."""
    if args.batch_size < 1 or args.num_iters < 1 or args.num_iters_warmup < 0:
        raise ValueError("--batch-size and --num-iters must be positive, warm-up >= 0")
    model_dir, shape = prepare_model(args)
    cfg = load_config(model_dir) if model_dir else {}
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    bandwidth = measure_copy_bandwidth(device)  # before the engine takes the memory
    threads = cpu_thread_count(args, device)
    if args.max_num_seqs is None:
        args.max_num_seqs = args.batch_size
    kwargs = engine_kwargs(args, model_dir, dtype,
                           args.max_model_len or args.input_len + args.output_len)
    reset_peak_memory(device)
    started = time.perf_counter()
    llm = build_llm(kwargs)
    startup = _startup(llm, time.perf_counter() - started)
    vocab = cfg.get("vocab_size", 32000)
    base_decode = None
    if speculative.decoder_of(llm) is not None:  # the same run without speculation first
        base_iters = speculative.without_speculation(llm, lambda: _run_iterations(
            llm, args, vocab, speculative.remember_outputs))
        base_decode = _rate_stats([s["decode_tok_s"] for s in base_iters])["median"]
    iters = _run_iterations(llm, args, vocab)
    decode = _rate_stats([s["decode_tok_s"] for s in iters])
    quant = getattr(getattr(llm, "engine_config", None), "quant", None)
    sol = speed_of_light(cfg, dtype, bandwidth, args.batch_size, args.input_len, args.output_len,
                         getattr(quant, "method", None),
                         getattr(quant, "lm_head", None)) if cfg else {}
    bound = sol.get("bound_tok_s")
    pct = 100 * decode["median"] / bound if bound and decode["median"] else None
    bound_kv = sol.get("bound_with_kv_tok_s")
    return {
        "mode": "latency",
        "workload": args.label or f"latency b{args.batch_size} {args.input_len}/{args.output_len}",
        "model": model_info(shape, model_dir, cfg), "dtype": dtype,
        "quantization": getattr(args, "quantization", None),
        "engine": {**engine_settings(llm, kwargs, device), "cpu_threads": threads},
        "batch_size": args.batch_size, "input_len": args.input_len,
        "output_len": args.output_len, "num_iters": args.num_iters,
        "num_iters_warmup": args.num_iters_warmup,
        "decode_tok_s": decode,
        "e2e_tok_s": _rate_stats([s["e2e_tok_s"] for s in iters]),
        "ttft_ms": report.summarize([s["ttft_s"] for s in iters]),
        "e2e_ms": report.summarize([s["e2e_s"] for s in iters]),
        "copy_bandwidth_gbps": bandwidth / 1e9 if bandwidth else None,
        "sol_bound_tok_s": bound, "sol_pct": pct,
        "sol_bound_with_kv_tok_s": bound_kv,
        "sol_pct_with_kv": 100 * decode["median"] / bound_kv
        if bound_kv and decode["median"] else None,
        "sol_detail": {**sol, "note": "linear layers counted at their quantization method's "
                       "bytes per weight, everything else at the engine dtype"},
        "startup_s": startup,
        "peak_gpu_memory_gib": peak_memory_gib(device)["allocated"],
        "gpu_memory_gib": peak_memory_gib(device),
        "meta": report.run_meta(),
        "speculative": speculative.summary(llm, base_decode, decode["median"])
        if speculative.decoder_of(llm) is not None else None,
    }


def _startup(llm, seconds: float) -> dict[str, Any]:
    """The engine's start-up phases (read weights, quantize, tune, profile memory, warm up,
    capture graphs) and LLM(...)'s whole wall time, in seconds."""
    phases = getattr(getattr(llm, "engine", None), "startup_phases", None) or {}
    return {**phases, "llm_init": round(seconds, 3)}
