"""Where an engine step's time goes on W2 / W3 / W4, part by part, against each part's floor.

For each workload a batch of requests runs through a real engine (`LLM` with its default
limits unless told otherwise) and torch.profiler records a few windows of steps spread over the
run. Two passes:

- **Attribution** (one step at a time: no async scheduling, no multi-step decode): every
  kernel lies inside its step, so each step's kernels are summed by kind (GEMM, attention,
  norms and small kernels, copies) and the step's wall time less its GPU busy time is the host
  gap. GEMM and attention time of a step holding both prefill and decode tokens is split in
  proportion to each side's floor.
- **Normal** (the engine's own modes, async and multi-step on): only the idle GPU share of the
  wall time, which the overlap modes exist to shrink.

Each part's floor comes from counted work: GEMM FLOPs at the GEMM peak (or the weights' bytes
at the copy bandwidth, whichever is longer), decode attention's K/V bytes at the copy bandwidth,
prefill attention's FLOPs at the bf16 peak, the norms' and activations' bytes at the copy
bandwidth. The peaks are measured in the same run (a large GEMM, a device copy); `PEAKS` holds
reference figures for H100 and H200. On a CPU the same runs on aten ops (for tests).

    python benchmarks/profile_steps.py --model llama-3.1-8b [--quantization fp8
        --kv-cache-dtype fp8] [--workloads W2,W3,W4] [--output-json F]
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import numpy as np
import torch

from slipstream.bench import report
from slipstream.bench.kernel_spans import annotations, attribute, busy_time, device_spans, trace_events
from slipstream.bench.shapes import is_shape_name, load_config, resolve_model
from slipstream.bench.step_floors import (
    PART_NAMES,
    PARTS,
    ModelShape,
    Peaks,
    StepWork,
    floors,
    measure_peaks,
    reference_peaks,
    step_work,
)

# (input, output) tokens of the standard workloads (BENCHMARKS.md).
WORKLOADS = {"W2": (128, 128), "W3": (1000, 1000), "W4": (2048, 128)}

# ---- running the engine ----------------------------------------------------------------------


class WorkRecorder:
    """Wraps the scheduler's schedule() to keep each step's StepWork."""

    def __init__(self, scheduler) -> None:
        self.steps: list[StepWork] = []
        self._scheduler = scheduler
        self._schedule = scheduler.schedule
        scheduler.schedule = self._record

    def _record(self):
        out = self._schedule()
        self.steps.append(step_work(out))
        return out

    def detach(self) -> None:
        del self._scheduler.schedule  # the class's method again


def set_modes(core, normal: dict[str, Any], attribution: bool) -> None:
    """One step at a time (attribution) or the engine's own overlap modes; engine idle."""
    sched = core.config.scheduler
    changes = {"async_scheduling": False, "decode_steps": 1} if attribution else normal
    core.config = core.config.replace(scheduler=dataclasses.replace(sched, **changes))


def add_requests(
    core, n: int, input_len: int, output_len: int, vocab: int, seed: list[int], tag: str
) -> None:
    from slipstream.engine.request import Request
    from slipstream.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    for i in range(n):
        ids = rng.integers(10, vocab - 10, size=input_len).tolist()
        core.add_request(Request(f"{tag}-{i}", ids, params))


def window_starts(total_steps: int, windows: int, length: int) -> list[int]:
    """Starts of up to `windows` windows of `length` steps spread evenly over a run, none
    overlapping the one before."""
    last = max(total_steps - length, 0)
    if windows <= 1:
        return [0]
    starts: list[int] = []
    for start in (round(i * last / (windows - 1)) for i in range(windows)):
        if not starts or start >= starts[-1] + length:
            starts.append(start)
    return starts


def expected_steps(n: int, input_len: int, output_len: int, max_tokens: int, max_seqs: int) -> int:
    waves = -(-n // max_seqs)
    return waves * (-(-min(n, max_seqs) * input_len // max_tokens) + output_len)


def run_pass(core, starts: list[int], length: int, max_steps: int, cuda: bool, sync: bool):
    """Step the engine through the windows starting at `starts` (or for max_steps when there
    are none), profiling them, then drop what is left; returns per window (its trace events,
    the index of its first step). sync: wait for the GPU after each profiled step, so that its
    kernels lie inside its host range."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    traces, step = [], 0
    profiling = bool(starts)
    while core.has_unfinished_requests() and step < max_steps and (starts or not profiling):
        if starts and step == starts[0]:
            starts.pop(0)
            with torch.profiler.profile(activities=activities) as prof:
                for i in range(length):
                    if not core.has_unfinished_requests():
                        break
                    with torch.profiler.record_function(f"profile_step_{i}"):
                        core.step()
                        if cuda and sync:
                            torch.cuda.synchronize()
            traces.append((trace_events(prof), step))
            step += length
            continue
        core.step()
        step += 1
    if core.has_unfinished_requests():  # past the last window: the rest is not needed
        core.abort_requests(list(core.scheduler.requests))
        while core.has_unfinished_requests():
            core.step()
    return traces


def profile_workload(
    core, name: str, args, model: ModelShape, peaks: Peaks, vocab: int, normal: dict[str, Any]
) -> dict[str, Any]:
    input_len, output_len = scaled(WORKLOADS[name], args.length_scale)
    sched = core.config.scheduler
    n = args.num_requests or sched.max_num_seqs
    total = expected_steps(n, input_len, output_len, sched.max_num_tokens, sched.max_num_seqs)
    starts = window_starts(min(total, args.max_steps), args.windows, args.window_steps)
    cuda = core.config.device.startswith("cuda")

    batches = iter(range(3))

    def new_batch(tag: str) -> None:  # fresh prompts each time: no prefix-cache hits
        seed = [args.seed, list(WORKLOADS).index(name), next(batches)]
        add_requests(core, n, input_len, output_len, vocab, seed, tag)

    # Warm-up: the first steps' shapes compile and tune here, not inside a profiled window.
    set_modes(core, normal, attribution=True)
    new_batch(f"{name}-w")
    run_pass(core, [], 0, args.warmup_steps, cuda, sync=True)
    new_batch(f"{name}-a")
    attributed = attribution_pass(core, starts, args, model, peaks, cuda)
    set_modes(core, normal, attribution=False)
    new_batch(f"{name}-n")
    idle = normal_idle_share(core, starts, args, cuda)
    return {
        "workload": name,
        "input_len": input_len,
        "output_len": output_len,
        "num_requests": n,
        "window_starts": starts,
        **attributed,
        "normal_mode_idle_share": idle,
    }


def attribution_pass(
    core, starts: list[int], args, model: ModelShape, peaks: Peaks, cuda: bool
) -> dict[str, Any]:
    """One step at a time: each profiled step's parts and floors, averaged per step."""
    recorder = WorkRecorder(core.scheduler)
    parts = dict.fromkeys(PARTS, 0.0)
    floor_sum = dict.fromkeys(PARTS, 0.0)
    counted = kernels = 0
    try:
        traces = run_pass(core, list(starts), args.window_steps, args.max_steps, cuda, sync=True)
    finally:
        recorder.detach()
    for events, first in traces:
        spans = device_spans(events, cuda)
        for i, window in enumerate(annotations(events, "profile_step_")):
            work = recorder.steps[first + i] if first + i < len(recorder.steps) else StepWork()
            if work.tokens == 0:
                continue
            floor = floors(work, model, peaks)
            for p, v in attribute(window, spans, work, floor).items():
                parts[p] += v
            for p, v in floor.items():
                floor_sum[p] += v
            kernels += sum(window[0] <= sp.start < window[1] for sp in spans)
            counted += 1
    return {
        "profiled_steps": counted,
        # A step with no kernels seen would mean the profiler missed graph replays.
        "kernels_per_step": kernels / counted if counted else None,
        "ms_per_step": _ms({p: parts[p] / counted if counted else None for p in PARTS}),
        "floor_ms_per_step": _ms({p: floor_sum[p] / counted if counted else None for p in PARTS}),
    }


def normal_idle_share(core, starts: list[int], args, cuda: bool) -> float | None:
    """The engine's own modes: the share of the profiled windows' wall time the GPU idled."""
    idle = wall = 0.0
    for events, _ in run_pass(core, list(starts), args.window_steps, args.max_steps, cuda, sync=False):
        ranges = annotations(events, "profile_step_")
        if not ranges:
            continue
        lo, hi = ranges[0][0], ranges[-1][1]
        spans = [s for s in device_spans(events, cuda) if lo <= s.start < hi]
        wall += hi - lo
        idle += max((hi - lo) - busy_time(spans), 0.0)
    return idle / wall if wall else None


def scaled(lengths: tuple[int, int], scale: float) -> tuple[int, int]:
    return tuple(max(1, round(n * scale)) for n in lengths)


def _ms(values: dict[str, float | None]) -> dict[str, float | None]:
    return {k: None if v is None else v * 1e3 for k, v in values.items()}


# ---- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="profile_steps", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama-3.1-8b", help="shape name or checkpoint directory")
    p.add_argument("--workloads", default="W2,W3,W4")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's own")
    p.add_argument("--max-num-tokens", type=int, default=None, help="default: the engine's own")
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per workload (default: one full batch, max_num_seqs)",
    )
    p.add_argument("--windows", type=int, default=4, help="profiled windows per workload")
    p.add_argument("--window-steps", type=int, default=4, help="steps per window")
    p.add_argument("--max-steps", type=int, default=400, help="steps per pass at most")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=16,
        help="unprofiled steps of each workload first (compiles, tuners)",
    )
    p.add_argument(
        "--length-scale",
        type=float,
        default=1.0,
        help="scale the workloads' input / output lengths (CPU tests)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def build_engine(args: argparse.Namespace):
    from slipstream import LLM

    model_dir, _ = resolve_model(args.model)
    lengths = [scaled(WORKLOADS[w], args.length_scale) for w in workload_names(args)]
    kwargs = dict(
        model=model_dir,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_tokens=args.max_num_tokens,
        device=args.device,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=max(i + o for i, o in lengths),
    )
    if is_shape_name(args.model):
        kwargs["load_format"] = "dummy"
    return LLM(**kwargs), model_dir


def workload_names(args: argparse.Namespace) -> list[str]:
    names = [w.strip().upper() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    return names


def run(args: argparse.Namespace) -> dict[str, Any]:
    llm, model_dir = build_engine(args)
    core, config = llm.engine, llm.engine.config
    cfg = load_config(model_dir)
    kv_dtype = core.runner.kv_cache_dtype
    model = ModelShape.from_config(cfg, config.dtype, config.quant.method, kv_dtype.itemsize)
    device = torch.device(config.device)
    peaks = measure_peaks(device, fp8=config.quant.method in ("fp8", "w8a8_sq"))
    sched = config.scheduler
    normal = {"async_scheduling": sched.async_scheduling, "decode_steps": sched.decode_steps}
    results = [
        profile_workload(core, name, args, model, peaks, cfg["vocab_size"], normal)
        for name in workload_names(args)
    ]
    return {
        "model": args.model,
        "quantization": config.quant.method,
        "dtype": config.dtype,
        "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
        "device": config.device,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "max_num_seqs": sched.max_num_seqs,
        "max_num_tokens": sched.max_num_tokens,
        "peaks_measured": {
            "gemm_tflops": peaks.gemm_flops / 1e12,
            "bf16_tflops": peaks.bf16_flops / 1e12,
            "copy_tbs": peaks.copy_bytes / 1e12,
        },
        "peaks_reference": reference_peaks(device),
        "workloads": results,
    }


def table(result: dict[str, Any]) -> str:
    """One block per workload: each part's ms per step, its share, its floor and the gap."""
    pk = result["peaks_measured"]
    lines = [
        f"step profile: {result['model']} ({result['quantization'] or result['dtype']}, KV "
        f"{result['kv_cache_dtype']}) on {result['device_name']}, limits "
        f"{result['max_num_seqs']} seqs / {result['max_num_tokens']} tokens; measured peaks "
        f"GEMM {pk['gemm_tflops']:.3g} TFLOP/s, bf16 {pk['bf16_tflops']:.3g}, copy "
        f"{pk['copy_tbs']:.3g} TB/s"
    ]
    for w in result["workloads"]:
        ms, fl = w["ms_per_step"], w["floor_ms_per_step"]
        total = sum(v for v in ms.values() if v is not None) if w["profiled_steps"] else 0.0
        idle = w["normal_mode_idle_share"]
        lines.append(
            f"\n{w['workload']} {w['input_len']}/{w['output_len']} x "
            f"{w['num_requests']}: {w['profiled_steps']} steps profiled "
            f"({w['kernels_per_step'] or 0:.0f} kernels a step), "
            f"{total:.2f} ms a step (one at a time); idle GPU in normal mode "
            f"{'-' if idle is None else f'{100 * idle:.1f}%'}"
        )
        lines.append(f"  {'part':<26}{'ms/step':>9}{'share':>8}{'floor ms':>10}{'x floor':>9}")
        for p in PARTS:
            if ms[p] is None:
                continue
            share = 100 * ms[p] / total if total else 0.0
            gap = f"{ms[p] / fl[p]:.2f}" if fl[p] else "-"
            lines.append(f"  {PART_NAMES[p]:<26}{ms[p]:>9.3f}{share:>7.1f}%{fl[p]:>10.3f}{gap:>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    result["meta"] = report.run_meta()
    report.write_json(result, args.output_json)
    print(table(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
