"""Where a step's time goes on the GPU: kernel totals (torch profiler) and host phases.

    python tools/profile_decode.py --model llama-3.1-8b --batch-size 1 --steps 64
    python tools/profile_decode.py --batch-size 512 --num-requests 2048 --steps 128 \
        --max-num-tokens 8192 --quantization fp8      # W2-like mixed prefill/decode steps
Prints the top CUDA kernels by total time over the profiled run, each kernel's share of the
critical path, the GPU-busy share of the wall time, and the per-phase host breakdown from the
engine's step timer. Then the idle gaps of the decode's kernel timeline by the kernels on
either side (a gap between graph replays or around the greedy argmax shows as such), the
unprofiled decode time per token and, in the same process, one decode step's CUDA graph
replayed back to back: the difference is what the engine adds around the graph.

Under PDL a kernel starts while the one before it runs and waits on the device, so its duration
counts the wait: the critical-path table charges each kernel only the time from the previous
kernel's end to its own end (and the idle gaps, below _STEP_GAP_US, to "(idle)"). The profiler
itself adds time per kernel (on the H200 the fp8 W1 critical path read ~3.3 ms per step against
2.75 ms unprofiled): read the shares, not the absolute figures.
"""
from __future__ import annotations

import argparse
import time

import torch

from slipstream import LLM, SamplingParams
from slipstream.bench.shapes import resolve_model

_STEP_GAP_US = 200.0  # a longer idle gap is the host between steps (slowed by the profiler)


def device_spans(events) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every device event, in time order."""
    return sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                  if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)


def critical_path(events) -> dict[str, tuple[float, int]]:
    """{name: (us on the critical path, calls)} over the device events in time order."""
    spans = device_spans(events)
    cost: dict[str, list] = {}
    prev_end = None
    for start, end, name in spans:
        entry = cost.setdefault(name, [0.0, 0])
        if prev_end is not None and prev_end < start <= prev_end + _STEP_GAP_US:
            idle = cost.setdefault("(idle)", [0.0, 0])
            idle[0] += start - prev_end
            idle[1] += 1
        entry[0] += max(end - max(start, prev_end or start), 0.0)
        entry[1] += 1
        prev_end = end if prev_end is None else max(prev_end, end)
    return {name: (us, n) for name, (us, n) in cost.items()}


def idle_gaps(events, steps: int, top: int) -> None:
    """Idle time per step by (kernel before, kernel after), below _STEP_GAP_US."""
    spans = device_spans(events)
    gaps: dict[str, list[float]] = {}
    prev_end, prev = None, ""
    for start, end, name in spans:
        if prev_end is not None and prev_end < start <= prev_end + _STEP_GAP_US:
            gaps.setdefault(f"{prev[:34]} -> {name[:34]}", []).append(start - prev_end)
        if prev_end is None or end > prev_end:
            prev_end, prev = end, name
    print("\nidle gaps per step (profiler on), by the kernels on either side")
    print(f"{'between':<72} {'gaps/step':>9} {'us/step':>8}")
    for key, v in sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{key:<72} {len(v) / steps:>9.1f} {sum(v) / steps:>8.1f}")


def decode_us_per_token(outputs) -> float:
    """Unprofiled: (last finish - first token) / decode tokens, as `bench latency` counts."""
    m = [o.metrics for o in outputs]
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outputs)
    return 1e6 * (max(x.finished_time for x in m) - min(x.first_token_time for x in m)) / tokens


def graph_step_us(llm, replays: int = 200) -> float | None:
    """One decode step's captured graph (the smallest batch size) replayed back to back."""
    graphs = getattr(llm.engine.runner, "_graphs", None)
    if graphs is None or not graphs.graphs:
        return None
    g = graphs.graphs[min(graphs.graphs)]
    for _ in range(10):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / replays


def print_critical_path(events, steps: int, top: int) -> None:
    """The critical path per engine step (prefill included in the average)."""
    cost = critical_path(events)
    total = sum(us for us, _ in cost.values())
    print(f"\ncritical path: {total / steps:.1f} us per step over {steps} steps (profiler on)")
    print(f"{'kernel':<70} {'calls/step':>10} {'us/step':>9} {'share':>6}")
    for name, (us, n) in sorted(cost.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{name[:70]:<70} {n / steps:>10.1f} {us / steps:>9.1f} {100 * us / total:>5.1f}%")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--num-requests", type=int, default=None, help="default: the batch size")
    p.add_argument("--max-num-tokens", type=int, default=2048)
    p.add_argument("--quantization", default=None)
    p.add_argument("--quantize-lm-head", action="store_true", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--top", type=int, default=22, help="kernels to list")
    ns = p.parse_args()
    num_requests = ns.num_requests or ns.batch_size
    model_dir, _ = resolve_model(ns.model)
    llm = LLM(model_dir, load_format="dummy", dtype="bfloat16",
              max_num_seqs=max(ns.batch_size, 1), max_model_len=ns.input_len + ns.steps + 64,
              enforce_eager=ns.enforce_eager, quantization=ns.quantization,
              kv_cache_dtype=ns.kv_cache_dtype, quantize_lm_head=ns.quantize_lm_head,
              max_num_tokens=max(ns.max_num_tokens, ns.input_len))
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(ns.input_len)] for i in range(num_requests)]
    params = SamplingParams(max_tokens=ns.steps, ignore_eos=True, temperature=0)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    unprofiled = decode_us_per_token(llm.generate([[t + 3 for t in p] for p in prompts], params,
                                                  use_tqdm=False))
    prompts = [[t + 1 for t in p] for p in prompts]
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or
              getattr(e, "self_device_time_total", 0) > 0]
    events.sort(key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)
    busy = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
    print(f"{'kernel':<70} {'calls':>7} {'total ms':>9} {'us/call':>8}")
    for e in events[:ns.top]:
        total = getattr(e, "self_device_time_total", 0)
        print(f"{e.key[:70]:<70} {e.count:>7} {total / 1e3:>9.2f} {total / max(e.count, 1):>8.1f}")
    tokens = num_requests * ns.steps
    print(f"\nwall {wall * 1e3:.1f} ms for {num_requests} x {ns.steps} tokens "
          f"({wall / tokens * 1e6:.1f} us/token, profiler on); GPU busy {busy * 1e3:.1f} ms = "
          f"{100 * busy / wall:.0f}% of wall")
    print_critical_path(prof.events(), ns.steps, ns.top)
    idle_gaps(prof.events(), ns.steps, ns.top)
    graph = graph_step_us(llm)
    print(f"\nunprofiled: decode {unprofiled:.1f} us/token; the step's graph alone "
          f"{graph or float('nan'):.1f} us (back to back)")
    llm.engine.timer.enabled = True
    llm.generate([[t + 2 for t in p] for p in prompts], params, use_tqdm=False)
    print("\nhost phases (synchronised; slows the run):\n" + llm.engine.timer.table())


if __name__ == "__main__":
    main()
