"""`slipstream bench throughput`: N requests handed to the engine at once, offline.

Reports output and total tok/s, TTFT / TPOT / ITL / end-to-end latency, peak GPU memory and KV
cache use; with `--baseline hf` the same requests (or the first --hf-num-requests of them) also
run through transformers `generate` in this process, first, so both fit on the device.
"""
from __future__ import annotations

import argparse
import math
import time
from typing import Any

from slipstream.bench import report, speculative
from slipstream.bench.datasets import BenchRequest, make_requests, random_requests
from slipstream.bench.hf_baseline import run_hf_baseline
from slipstream.bench.shapes import count_parameters, is_shape_name, load_config, resolve_model
from slipstream.engine.args import EngineArgs
from slipstream.llm import LLM
from slipstream.sampling_params import SamplingParams

# Engine flags always passed to LLM(...); every other EngineArgs field is passed when it differs
# from its default (so the call stays small, and no engine flag is parsed and then dropped).
_ENGINE_KWARGS = ("dtype", "max_num_seqs", "max_num_tokens", "max_model_len", "block_size",
                  "gpu_memory_utilization", "seed", "load_format")
_KV_TOTAL_KEYS = ("num_total_blocks", "num_kv_blocks", "kv_num_blocks", "num_blocks", "kv_blocks_total",
                  "total_blocks", "num_gpu_blocks")
_KV_PEAK_KEYS = ("peak_used_blocks", "kv_peak_used_blocks", "max_used_blocks",
                 "peak_kv_blocks_used")


def resolve_device(device: str | None) -> str:
    import torch

    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str | None, device: str) -> str:
    if dtype in (None, "auto"):
        return "bfloat16" if device.startswith("cuda") else "float32"
    return dtype


def engine_kwargs(args: argparse.Namespace, model_dir: str | None, dtype: str,
                  max_model_len: int) -> dict[str, Any]:
    """The LLM(...) keyword arguments of this run."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    kwargs: dict[str, Any] = {"model": model_dir}
    for name in _ENGINE_KWARGS:
        if getattr(args, name, None) is not None:
            kwargs[name] = getattr(args, name)
    for name in defaults.keys() - {*_ENGINE_KWARGS, "model"}:
        value = getattr(args, name, defaults.get(name))
        if value != defaults.get(name):
            kwargs[name] = value
    kwargs.update(dtype=dtype, max_model_len=max_model_len)
    return kwargs


def cpu_thread_count(args: argparse.Namespace, device: str) -> int | None:
    """On a CPU: the engine's thread choice (runner/cpu_threads.py), made now so a baseline run
    in this process uses the same count; None elsewhere."""
    if not device.startswith("cpu"):
        return None
    from slipstream.runner.cpu_threads import configure_cpu_threads

    return configure_cpu_threads(getattr(args, "cpu_threads", None))


def build_llm(kwargs: dict[str, Any]):
    return LLM(**kwargs)


def engine_settings(llm, kwargs: dict[str, Any], device: str) -> dict[str, Any]:
    """Limits actually in force: read back from llm.engine_config where it exists."""
    cfg = getattr(llm, "engine_config", None)
    sched, cache = getattr(cfg, "scheduler", None), getattr(cfg, "cache", None)
    eager = bool(getattr(cfg, "enforce_eager", kwargs.get("enforce_eager", False)))
    return {
        "max_num_tokens": getattr(sched, "max_num_tokens", kwargs.get("max_num_tokens")),
        "max_batch_size": getattr(sched, "max_num_seqs", kwargs.get("max_num_seqs")),
        "max_model_len": getattr(sched, "max_model_len", kwargs.get("max_model_len")),
        "block_size": getattr(cache, "block_size", kwargs.get("block_size", 16)),
        "cuda_graphs": device.startswith("cuda") and not eager,
        "enable_prefix_caching": getattr(cache, "enable_prefix_caching", None),
        "gpu_memory_utilization": getattr(cache, "gpu_memory_utilization", None),
        "load_format": getattr(cfg, "load_format", kwargs.get("load_format")),
        "decode_steps": getattr(sched, "decode_steps", None),
        "pipeline_decode": getattr(sched, "pipeline_decode", None),
        "async_scheduling": getattr(sched, "async_scheduling", None),
        "device": device,
    }


def model_info(shape: str, model_dir: str | None, cfg: dict[str, Any]) -> dict[str, Any]:
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    try:
        params = count_parameters(cfg)
    except KeyError:
        params = None
    return {"shape": shape, "path": model_dir, "architecture": archs[0], "num_parameters": params}


def reset_peak_memory(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_memory_gib(device: str) -> dict[str, float | None]:
    import torch

    if not device.startswith("cuda"):
        return {"allocated": None, "reserved": None, "device_used": None}
    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.max_memory_allocated() / 2**30,
            "reserved": torch.cuda.max_memory_reserved() / 2**30,
            "device_used": (total - free) / 2**30}


def sampling_params_for(requests: list[BenchRequest]):
    """Greedy, EOS ignored, exactly each request's output length (one object if all equal)."""
    lengths = {r.output_len for r in requests}
    if len(lengths) == 1:
        return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=lengths.pop())
    return [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.output_len)
            for r in requests]


def warmup_engine(llm, requests: list[BenchRequest], vocab: int, seed: int, count: int) -> None:
    """A few short requests of the workload's prompt lengths, with fresh ids (no prefix hits),
    so first-use compilation and autotuning stay out of the timed run."""
    if count <= 0:
        return
    sample = requests[:count]
    fresh = random_requests(len(sample), max(r.input_len for r in sample), 4, vocab, seed + 7919)
    warm = [BenchRequest(f.prompt_token_ids[:r.input_len], min(4, r.output_len))
            for f, r in zip(fresh, sample)]
    llm.generate([w.prompt_token_ids for w in warm], sampling_params_for(warm), use_tqdm=False)


def latency_stats(outputs: list[Any]) -> dict[str, dict[str, Any]]:
    """TTFT, TPOT, ITL and E2E over requests. Offline metrics hold no per-token timestamps, so
    ITL is each request's mean inter-token gap (its TPOT); its mean equals TPOT's."""
    ttft, tpot, e2e = [], [], []
    parts: dict[str, list[float | None]] = {name: [] for name in TTFT_PARTS}
    for out in outputs:
        m = getattr(out, "metrics", None)
        if m is None:
            continue
        ttft.append(m.time_to_first_token)
        tpot.append(m.time_per_output_token)
        if m.finished_time is not None:
            e2e.append(m.finished_time - m.arrival_time)
        for name, values in parts.items():
            values.append(getattr(m, name, None))
    itl = report.summarize(tpot)
    itl["source"] = "per-request mean inter-token gap"
    return {"ttft_ms": report.summarize(ttft), "tpot_ms": report.summarize(tpot),
            "itl_ms": itl, "e2e_ms": report.summarize(e2e),
            # TTFT = queue + prefill + output delay, per request (outputs.RequestMetrics).
            "ttft_parts_ms": {name: report.summarize(values) for name, values in parts.items()}}


TTFT_PARTS = ("queue_time", "prefill_time", "output_delay")


class StepProbe:
    """Reads the engine's stats after every step, in the stepping thread (so it races with
    nothing): peak KV use, peak running batch and the number of steps. Installs only where
    the LLM steps an in-process engine (`llm.engine.step`); costs one small dict per step."""

    def __init__(self, llm) -> None:
        self.steps, self.peak_usage, self.peak_running = 0, 0.0, 0
        self._llm, self._engine = llm, getattr(llm, "engine", None)
        self.installed = callable(getattr(self._engine, "step", None)) and \
            callable(getattr(llm, "get_stats", None))
        if self.installed:
            step = self._engine.step

            def probed_step(*args: Any, **kwargs: Any) -> Any:
                out = step(*args, **kwargs)
                self._sample()
                return out

            self._engine.step = probed_step

    def _sample(self) -> None:
        stats = self._llm.get_stats()
        self.steps += 1
        self.peak_usage = max(self.peak_usage, float(stats.get("kv_cache_usage") or 0.0))
        self.peak_running = max(self.peak_running, int(stats.get("num_running") or 0))

    def remove(self) -> None:
        if self.installed:
            del self._engine.step  # the instance attribute; the class method shows again
            self.installed = False

    def summary(self) -> dict[str, Any]:
        if not self.steps:
            return {"num_steps": None, "peak_kv_usage": None, "peak_running": None}
        return {"num_steps": self.steps, "peak_kv_usage": self.peak_usage,
                "peak_running": self.peak_running}


def _first_key(stats: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((stats[k] for k in keys if stats.get(k) is not None), None)


def kv_summary(llm, requests: list[BenchRequest], block_size: int, max_batch: int | None,
               probe: dict[str, Any] | None = None) -> dict[str, Any]:
    """KV blocks in the pool, peak use (the engine's own figure, else the step probe's) and
    the blocks a full batch of these requests needs at its longest (did KV limit the batch?)."""
    stats = llm.get_stats() if hasattr(llm, "get_stats") else {}
    stats = {k: v for k, v in (stats or {}).items() if isinstance(v, (int, float, str, bool))}
    cfg_blocks = getattr(getattr(getattr(llm, "engine_config", None), "cache", None),
                         "num_blocks", None)
    total = _first_key(stats, _KV_TOTAL_KEYS) or cfg_blocks
    peak = _first_key(stats, _KV_PEAK_KEYS)
    probe_usage = (probe or {}).get("peak_kv_usage")
    if peak is None and probe_usage is not None and total:
        peak = round(probe_usage * total)
    batch = requests[: max_batch or len(requests)]
    needed = sum(math.ceil((r.input_len + r.output_len) / block_size) for r in batch)
    util = peak / total if peak is not None and total else None
    return {"num_blocks": total, "block_size": block_size, "peak_used_blocks": peak,
            "utilization": util, "blocks_for_full_batch": needed, "engine_stats": stats}


def run_engine(llm, requests: list[BenchRequest]) -> tuple[list[Any], float]:
    prompts = [r.prompt_token_ids for r in requests]
    params = sampling_params_for(requests)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, time.perf_counter() - start


def timed_run(llm, requests: list[BenchRequest]) -> tuple[list[Any], float, dict[str, Any]]:
    """The timed generate() with the step probe around it: (outputs, wall seconds, steps)."""
    probe = StepProbe(llm)
    try:
        outputs, wall = run_engine(llm, requests)
    finally:
        probe.remove()
    steps = probe.summary()
    steps["steps_per_s"] = steps["num_steps"] / wall if steps["num_steps"] else None
    return outputs, wall, steps


def token_counts(outputs: list[Any], requests: list[BenchRequest],
                 wall: float) -> dict[str, Any]:
    """Tokens in and out (as produced), and the rates over the wall time."""
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    total_out, total_in = sum(produced), sum(r.input_len for r in requests)
    return {
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "output_len_mismatches": sum(p != r.output_len for p, r in zip(produced, requests)),
        "wall_time_s": wall, "output_tok_s": total_out / wall,
        "total_tok_s": (total_out + total_in) / wall, "requests_per_s": len(requests) / wall,
    }


def _workload_label(args: argparse.Namespace, requests: list[BenchRequest]) -> str:
    if args.label:
        return args.label
    if args.dataset == "w5":
        return f"w5 mixed x{len(requests)}"
    return f"random {args.input_len}/{args.output_len} x{len(requests)}"


def run_baseline(args, model_dir, requests, dtype, device) -> dict[str, Any] | None:
    if args.baseline != "hf":
        return None
    subset = requests[: args.hf_num_requests or len(requests)]
    print(f"[bench] HF baseline: {len(subset)} requests, static batches of "
          f"{args.hf_batch_size}", flush=True)
    return run_hf_baseline(model_dir, subset, dtype=dtype, device=device,
                           batch_size=args.hf_batch_size).to_dict()


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """The whole throughput benchmark; returns the result dict (also printed / written)."""
    model_dir, shape = prepare_model(args)
    cfg = load_config(model_dir) if model_dir else {}
    vocab = cfg.get("vocab_size", 32000)
    requests = make_requests(args.dataset, num_requests=args.num_requests,
                             input_len=args.input_len, output_len=args.output_len,
                             vocab_size=vocab, seed=args.seed or 0)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    threads = cpu_thread_count(args, device)  # before the baseline: both run on the same count
    baseline = run_baseline(args, model_dir, requests, dtype, device) if model_dir else None
    needed_len = max(r.input_len + r.output_len for r in requests)
    kwargs = engine_kwargs(args, model_dir, dtype, args.max_model_len or needed_len)
    reset_peak_memory(device)
    llm = build_llm(kwargs)
    warmup_engine(llm, requests, vocab, args.seed or 0, args.warmup_requests)
    spec_base = None
    if speculative.decoder_of(llm) is not None:  # the same run without speculation first
        base_outputs, base_wall, _ = speculative.without_speculation(
            llm, lambda: timed_run(llm, requests))
        speculative.remember_outputs(base_outputs)
        spec_base = token_counts(base_outputs, requests, base_wall)["output_tok_s"]
    outputs, wall, steps = timed_run(llm, requests)
    settings = engine_settings(llm, kwargs, device)
    settings["cpu_threads"] = threads
    memory = peak_memory_gib(device)
    counts = token_counts(outputs, requests, wall)
    result: dict[str, Any] = {
        "mode": "throughput", "workload": _workload_label(args, requests),
        "model": model_info(shape, model_dir, cfg), "dtype": dtype,
        "quantization": getattr(args, "quantization", None), "engine": settings,
        "dataset": args.dataset, "num_requests": len(requests),
        "input_len": args.input_len if args.dataset == "random" else "mixed",
        "output_len": args.output_len if args.dataset == "random" else "mixed",
        **counts, **latency_stats(outputs),
        "peak_gpu_memory_gib": memory["allocated"], "gpu_memory_gib": memory,
        "kv_cache": kv_summary(llm, requests, settings["block_size"],
                               settings["max_batch_size"], steps),
        "steps": steps, "baseline": baseline,
        "ratio_vs_baseline": counts["output_tok_s"] / baseline["output_tok_s"]
        if baseline else None,
        "meta": report.run_meta(),
        "speculative": speculative.summary(llm, spec_base, counts["output_tok_s"])
        if spec_base is not None else None,
    }
    if counts["output_len_mismatches"]:
        print(f"[bench] WARNING: {counts['output_len_mismatches']} requests did not produce "
              "their output length", flush=True)
    return result


def prepare_model(args: argparse.Namespace) -> tuple[str | None, str]:
    """Resolve --model; a shape name has no weights, so it implies --load-format dummy."""
    model_dir, shape = resolve_model(args.model)
    if is_shape_name(args.model) and args.load_format in (None, "auto"):
        args.load_format = "dummy"
    return model_dir, shape
