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
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from slipstream.bench import report
from slipstream.bench.shapes import is_shape_name, load_config, resolve_model
from slipstream.models.sizes import dtype_bytes, linear_parameters

# Reference peaks (dense; TFLOP/s, TB/s of device copy counting read + write). H200: measured
# on the lent machine (BENCHMARKS.md); H100 SXM: the same kernels' usual share of its spec.
PEAKS = {
    "H200": {"bf16_tflops": 792.0, "fp8_tflops": 1435.0, "copy_tbs": 4.14},
    "H100": {"bf16_tflops": 720.0, "fp8_tflops": 1300.0, "copy_tbs": 2.95},
}

# (input, output) tokens of the standard workloads (BENCHMARKS.md).
WORKLOADS = {"W2": (128, 128), "W3": (1000, 1000), "W4": (2048, 128)}
PARTS = (
    "prefill_gemm",
    "decode_gemm",
    "prefill_attention",
    "decode_attention",
    "small",
    "copies",
    "host_gap",
)
PART_NAMES = {
    "prefill_gemm": "prefill GEMM",
    "decode_gemm": "decode GEMM",
    "prefill_attention": "attention prefill",
    "decode_attention": "attention decode",
    "small": "norms and small kernels",
    "copies": "copies (host <-> device)",
    "host_gap": "host gap (idle GPU)",
}

_GEMM = re.compile(
    r"gemm|gemv|nvjet|cutlass|xmma|cublas|sm\d\d_|_scaled_mm|matmul|splitk|"
    r"_w4_|_w8_|skinny|int8|fp8_dot|aten::(mm|addmm|bmm|baddbmm|_scaled_mm)$",
    re.IGNORECASE,
)
_ATTENTION = re.compile(r"attn|attention|flash|fmha|sdpa", re.IGNORECASE)
_CPU_OPS = re.compile(
    r"^aten::(mm|addmm|bmm|baddbmm|_scaled_mm|_scaled_dot_product_\w+|"
    r"_efficient_attention_forward|_flash_attention_forward)$"
)


def classify(name: str) -> str:
    """'gemm', 'attention' or 'small' for a kernel (or leaf aten op) name."""
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "gemm"
    return "small"


# ---- the work of a step, from the scheduler's output ---------------------------------------


@dataclass
class StepWork:
    """One step's tokens: prefill chunks (query length, start position), decode contexts."""

    prefill: list[tuple[int, int]] = field(default_factory=list)
    decode_ctx: list[int] = field(default_factory=list)
    sampled: int = 0

    @property
    def prefill_tokens(self) -> int:
        return sum(q for q, _ in self.prefill)

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + len(self.decode_ctx)


def step_work(sched_out) -> StepWork:
    work = StepWork()
    for seq in sched_out.seqs:
        if seq.num_tokens == 1 and seq.start_pos >= seq.request.num_prompt_tokens:
            work.decode_ctx.append(seq.start_pos + 1)
        else:
            work.prefill.append((seq.num_tokens, seq.start_pos))
        work.sampled += int(seq.needs_sample)
    return work


@dataclass(frozen=True)
class ModelShape:
    """What the floors need of a model (per rank)."""

    linear_params: int
    head_params: int
    weight_bytes_per_param: float
    layers: int
    heads: int
    head_dim: int
    hidden: int
    intermediate: int
    kv_bytes_per_token: int  # K and V, all layers
    act_bytes: int  # bytes of one activation element

    @staticmethod
    def from_config(
        cfg: dict[str, Any], dtype: str, quantization: str | None, kv_elem_bytes: int
    ) -> ModelShape:
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        kv_heads = cfg.get("num_key_value_heads") or heads
        elem = dtype_bytes(dtype)
        per_param = {"fp8": 1.0, "int8_wo": 1.0, "w8a8_sq": 1.0, "int4_awq": 0.53}.get(
            quantization or "", float(elem)
        )
        return ModelShape(
            linear_params=linear_parameters(cfg),
            head_params=cfg["vocab_size"] * cfg["hidden_size"],
            weight_bytes_per_param=per_param,
            layers=cfg["num_hidden_layers"],
            heads=heads,
            head_dim=head_dim,
            hidden=cfg["hidden_size"],
            intermediate=cfg["intermediate_size"],
            kv_bytes_per_token=2 * cfg["num_hidden_layers"] * kv_heads * head_dim * kv_elem_bytes,
            act_bytes=elem,
        )


@dataclass(frozen=True)
class Peaks:
    gemm_flops: float  # FLOP/s of the GEMMs (fp8 with fp8 weights)
    bf16_flops: float  # FLOP/s for attention's math
    copy_bytes: float  # bytes/s, read + write counted


def floors(work: StepWork, model: ModelShape, peaks: Peaks) -> dict[str, float]:
    """Seconds each part of the step cannot go below."""
    tokens = work.tokens
    if tokens == 0:
        return dict.fromkeys(PARTS, 0.0)
    gemm_flops = 2 * tokens * model.linear_params + 2 * work.sampled * model.head_params
    gemm_bytes = model.linear_params * model.weight_bytes_per_param + model.head_params * model.act_bytes
    gemm = max(gemm_flops / peaks.gemm_flops, gemm_bytes / peaks.copy_bytes)
    prefill_share = work.prefill_tokens / tokens
    attn_prefill_flops = sum(
        4 * model.layers * model.heads * model.head_dim * q * (start + (q + 1) / 2)
        for q, start in work.prefill
    )
    decode_bytes = sum(work.decode_ctx) * model.kv_bytes_per_token
    small_bytes = tokens * model.layers * model.act_bytes * (4 * model.hidden + 3 * model.intermediate)
    return {
        "prefill_gemm": gemm * prefill_share,
        "decode_gemm": gemm * (1 - prefill_share),
        "prefill_attention": attn_prefill_flops / peaks.bf16_flops,
        "decode_attention": decode_bytes / peaks.copy_bytes,
        "small": small_bytes / peaks.copy_bytes,
        "copies": 0.0,
        "host_gap": 0.0,
    }


# ---- the trace --------------------------------------------------------------------------------


@dataclass
class Span:
    name: str
    start: float  # microseconds, the profiler's clock
    end: float
    kind: str  # 'gemm' | 'attention' | 'small' | 'copies'


def trace_events(prof) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            return json.load(f).get("traceEvents", [])


def device_spans(events: list[dict], cuda: bool) -> list[Span]:
    """GPU kernels and copies (CUDA), or the leaf compute ops (CPU)."""
    spans = []
    for e in events:
        cat, name = e.get("cat", ""), e.get("name", "")
        if "ts" not in e or "dur" not in e:
            continue
        if cuda and cat == "kernel":
            kind = classify(name)
        elif cuda and cat in ("gpu_memcpy", "gpu_memset"):
            kind = "copies"
        elif not cuda and cat == "cpu_op" and _CPU_OPS.match(name):
            kind = classify(name)
        else:
            continue
        spans.append(Span(name, float(e["ts"]), float(e["ts"]) + float(e["dur"]), kind))
    return spans


def annotations(events: list[dict], prefix: str) -> list[tuple[float, float]]:
    """(start, end) of the host's `record_function(prefix + i)` ranges, in order of i."""
    found = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") == "user_annotation" and name.startswith(prefix):
            found[int(name[len(prefix) :])] = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
    return [found[i] for i in sorted(found)]


def busy_time(spans: list[Span]) -> float:
    """Length of the union of the spans (overlapping kernels counted once)."""
    total, end = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s.start):
        if s.start > end:
            total += s.end - s.start
            end = s.end
        elif s.end > end:
            total += s.end - end
            end = s.end
    return total


def attribute(
    window: tuple[float, float], spans: list[Span], work: StepWork, floor: dict[str, float]
) -> dict[str, float]:
    """Seconds of each part in one step (kernels that start inside its host range)."""
    mine = [s for s in spans if window[0] <= s.start < window[1]]
    by_kind = {
        k: sum(s.end - s.start for s in mine if s.kind == k) * 1e-6
        for k in ("gemm", "attention", "small", "copies")
    }
    gemm_share = work.prefill_tokens / work.tokens if work.tokens else 0.0
    attn_floor = floor["prefill_attention"] + floor["decode_attention"]
    attn_share = floor["prefill_attention"] / attn_floor if attn_floor else gemm_share
    wall = (window[1] - window[0]) * 1e-6
    return {
        "prefill_gemm": by_kind["gemm"] * gemm_share,
        "decode_gemm": by_kind["gemm"] * (1 - gemm_share),
        "prefill_attention": by_kind["attention"] * attn_share,
        "decode_attention": by_kind["attention"] * (1 - attn_share),
        "small": by_kind["small"],
        "copies": by_kind["copies"],
        "host_gap": max(wall - busy_time(mine) * 1e-6, 0.0),
    }


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
    """Starts of `windows` windows of `length` steps spread evenly over a run."""
    last = max(total_steps - length, 0)
    if windows <= 1:
        return [0]
    return sorted({round(i * last / (windows - 1)) for i in range(windows)})


def expected_steps(n: int, input_len: int, output_len: int, max_tokens: int, max_seqs: int) -> int:
    waves = -(-n // max_seqs)
    return waves * (-(-min(n, max_seqs) * input_len // max_tokens) + output_len)


def run_pass(core, starts: list[int], length: int, max_steps: int, cuda: bool, sync: bool):
    """Step the engine to the end (or max_steps), profiling the windows; returns per window
    (its trace events, the index of its first step). sync: wait for the GPU after each
    profiled step, so that its kernels lie inside its host range."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    traces, step = [], 0
    while core.has_unfinished_requests() and step < max_steps:
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
    if core.has_unfinished_requests():  # max_steps reached: the rest is not needed
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


# ---- peaks -----------------------------------------------------------------------------------


def measure_peaks(device: torch.device, fp8: bool) -> Peaks:
    """A large GEMM in bf16 (fp8 with fp8 weights) and a device copy, timed here."""
    cuda = device.type == "cuda"
    n = 8192 if cuda else 512
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    bf16 = 2 * n**3 / _timed(lambda: a @ b, cuda)
    gemm = bf16
    if fp8 and cuda:
        af, bf = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        gemm = 2 * n**3 / _timed(lambda: torch._scaled_mm(af, bf, one, one, out_dtype=torch.bfloat16), cuda)
    src = torch.empty(256 << 20 if cuda else 16 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = 2 * src.numel() / _timed(lambda: dst.copy_(src), cuda)
    return Peaks(gemm_flops=gemm, bf16_flops=bf16, copy_bytes=copy)


def _timed(fn, cuda: bool, reps: int = 10) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def reference_peaks(device: torch.device) -> dict[str, float] | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAKS.items() if k in name), None)


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
