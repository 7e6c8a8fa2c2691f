"""Host time of an offline batch with the model taken out: what the GPU waits for between steps.

    python benchmarks/bench_host.py [--num-requests 4000] [--input-len 128] [--output-len 128]
        [--decode-steps 8] [--async-scheduling] [--temperature 0] [--prepare-inputs]
The embedded default model's engine runs W2's request mix (512 running, 8192 tokens per step,
8 decode steps per host round trip, as `LLM` does) with a stub runner that returns tokens at
once, so the wall time is the host's own work: scheduling, block tables, stop checks and output
processing (printed per phase too). In a real run the GPU waits for all of it except the output
processing, which the offline loop does while the next step runs, and the update and scheduling
around decodes queued ahead (pipeline_decode; counted as `queued_decodes`).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from slipstream import LLM, SamplingParams
from slipstream.assets import default_model_path
from slipstream.runner.input_batch import build_host_batch
from slipstream.scheduler.output import RunnerOutput


class _Launched:
    """Stands in for runner.launched.LaunchedTokens (the engine core reads only on_device, to
    feed the next launch, which the stub ignores)."""

    def __init__(self, values: list):
        self.on_device = self.values = values


class StubRunner:
    """Answers every step at once with random token ids (the multi-step path included)."""

    def __init__(self, real, vocab_size: int, max_decode_batch: int, prepare: bool = False):
        self.timer = real.timer
        # prepare: build each step's host arrays as the real runner does (input preparation).
        self._prepare = getattr(real, "_host_batch", None) or (
            lambda sched: build_host_batch(sched.seqs, real.block_size))
        self._prepare = self._prepare if prepare else (lambda sched: None)
        self.max_decode_batch = max_decode_batch
        self.queued = 0  # decodes launched before the previous step's tokens were read
        self._rng = random.Random(0)
        self._pool = [self._rng.randrange(10, vocab_size) for _ in range(1 << 16)]

    def _tokens(self, n: int) -> list[int]:
        start = self._rng.randrange(len(self._pool) - n)
        return self._pool[start:start + n]

    def launch_decode_steps(self, sched, num_steps: int, feed=None) -> _Launched:
        self.queued += feed is not None
        self._prepare(sched)
        return _Launched([self._tokens(num_steps) for _ in sched.seqs])

    def collect_decode_steps(self, sched, tokens: _Launched) -> RunnerOutput:
        return RunnerOutput({s.request_id: row for s, row in zip(sched.seqs, tokens.values)})

    def execute_model(self, sched, while_gpu_runs=None, feed=None) -> RunnerOutput:
        self._prepare(sched)
        return RunnerOutput({s.request_id: self._tokens(1) for s in sched.seqs if s.needs_sample})

    def launch_sampled(self, sched, feed=None) -> _Launched:
        self._prepare(sched)
        return _Launched(self._tokens(sum(s.needs_sample for s in sched.seqs)))

    def collect_sampled(self, sched, tokens: _Launched) -> RunnerOutput:
        requests = [s.request for s in sched.seqs if s.needs_sample]
        return RunnerOutput({r.request_id: [t] for r, t in zip(requests, tokens.values)})


def _time_phases(llm) -> dict[str, float]:
    """Wrap the host phases of a step (and the output processing) to sum their wall time."""
    core = llm.engine
    totals: dict[str, float] = {}
    targets = [("schedule", core.scheduler, "schedule"), ("plan", core, "_plan_decode_steps"),
               ("update", core.scheduler, "update_from_output"),
               ("outputs", llm._outputs, "process")]
    for name, owner, attr in targets:
        fn = getattr(owner, attr)
        totals[name] = 0.0

        def timed(*args, _fn=fn, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                totals[_name] += time.perf_counter() - start

        setattr(owner, attr, timed)
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=4000)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sampled requests (the stub ignores it; it picks the engine path)")
    ap.add_argument("--prepare-inputs", action="store_true",
                    help="build each step's host arrays (block tables, positions, slots) too")
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()
    llm = LLM(str(default_model_path()), device="cpu", max_num_seqs=ns.max_num_seqs,
              max_num_tokens=8192, max_model_len=ns.input_len + ns.output_len + 8,
              kv_cache_memory=2 << 30, decode_steps=ns.decode_steps,
              async_scheduling=ns.async_scheduling)
    core = llm.engine
    core.runner = StubRunner(core.runner, llm.engine_config.model.vocab_size, ns.max_num_seqs,
                             ns.prepare_inputs)
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 4000) for _ in range(ns.input_len)]
               for _ in range(ns.num_requests)]
    params = SamplingParams(max_tokens=ns.output_len, ignore_eos=True,
                            temperature=ns.temperature)
    steps = 0
    step = core.step
    per_row: list[float] = []  # CPU seconds per running row, of each step with every seat taken

    def counted_step(**kwargs):
        nonlocal steps
        steps += 1
        rows = core.scheduler.num_running
        start = time.process_time()
        try:
            return step(**kwargs)
        finally:
            if rows == ns.max_num_seqs:
                per_row.append((time.process_time() - start) / rows)

    core.step = counted_step
    phases = _time_phases(llm)
    runs = []
    for _ in range(ns.repeat):  # the best of a few: a shared machine's timings are noisy
        steps = 0
        start, cpu = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append((time.perf_counter() - start, time.process_time() - cpu))
        assert all(len(o.outputs[0].token_ids) == ns.output_len for o in outs)
    wall = min(r[0] for r in runs)
    cpu = min(r[1] for r in runs)  # each the best run's: others on a shared machine add to both
    per_run = {name: total / ns.repeat for name, total in phases.items()}
    row_steps = ns.num_requests * ns.output_len  # one sampled token per row per step
    result = dict(num_requests=ns.num_requests, input_len=ns.input_len, output_len=ns.output_len,
                  temperature=ns.temperature, decode_steps=ns.decode_steps,
                  tokens_per_s=row_steps / wall, us_per_token=1e6 * wall / row_steps,
                  engine_steps=steps, host_s=wall, host_cpu_s=cpu, runs=runs,
                  host_ms_per_step=1e3 * wall / steps, phases_s=per_run,
                  queued_decodes=core.runner.queued // ns.repeat)
    print(f"{steps} engine steps ({core.runner.queued // ns.repeat} decodes fed on the device), host "
          f"{wall:.2f} s ({1e3 * wall / steps:.2f} ms per step; CPU {cpu:.2f} s); "
          f"runs {[round(r[0], 2) for r in runs]}")
    if per_row:  # robust to a busy machine: the median full step, not the whole run's mean
        result["full_step_us_per_row"] = 1e6 * statistics.median(per_row)
        result["full_step_us_per_row_min"] = 1e6 * min(per_row)
        print(f"steps with all {ns.max_num_seqs} seats taken: median "
              f"{1e6 * statistics.median(per_row):.1f}, min {1e6 * min(per_row):.1f} us CPU per "
              f"row ({len(per_row)} steps)")
    print(f"{row_steps / wall:,.0f} tokens/s, {1e6 * wall / row_steps:.1f} us per token "
          f"(CPU {1e6 * cpu / row_steps:.1f})")
    print("mean per run: " + ", ".join(f"{k} {v:.2f} s" for k, v in per_run.items()))
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
