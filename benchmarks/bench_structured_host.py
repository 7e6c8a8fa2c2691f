"""Host time per decode step that structured output adds, with the model taken out (CPU).

A tiny model on a GPU leaves the host as the bottleneck, so what the grammars add to the host's
step is what they cost in throughput. Here the embedded model's engine runs with its forward
replaced by random logits (the sampler, the grammars, the scheduler and the output processing
are the real ones, async steps on as with CUDA): N requests with a JSON schema each, and the
same prompts unconstrained generating exactly as many tokens, alternated. Printed: host ms per
step (wall and this process's CPU time, which other processes on a shared machine disturb
less) and the difference; and the constrained run with grammar-forced drafts, per token
(random logits accept only the truly forced drafts: a floor on what a model's drafts save).
Masks are applied by the CPU kernel here; on a GPU that is a kernel launch.

    python benchmarks/bench_structured_host.py [--rows 64] [--repeats 2] [--grammar-forced-drafts 8]
        [--output-json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

from benchmarks.bench_structured import schema_for
from slipstream import LLM, SamplingParams
from slipstream.assets import DEFAULT_MODEL_DIR
from slipstream.structured import StructuredOutputsParams


def stub_forward(llm: LLM) -> torch.Generator:
    """Replace the forward with random logits for the rows that sample (same shapes, no model);
    returns their generator (reseeded, a run repeats its outputs)."""
    runner = llm.engine.runner
    vocab = llm.engine_config.model.vocab_size
    gen = torch.Generator().manual_seed(0)

    def step_logits(sched, feed=None):
        seqs = [s for s in sched.seqs if s.needs_sample]
        if not seqs:
            return None, [], None
        rows = sum(s.num_spec_tokens + 1 for s in seqs)  # a verification: k + 1 rows
        return torch.randn(rows, vocab, generator=gen), [s.request for s in seqs], None

    runner._step_logits = step_logits
    return gen


def timed_run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    engine, steps = llm.engine, 0
    step = engine.step

    def counted(**kwargs):
        nonlocal steps
        steps += 1
        return step(**kwargs)

    engine.step = counted
    wall, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    engine.step = step
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "outs": outs,
        "steps": steps,
        "tokens": tokens,
        "wall_ms": 1e3 * wall / steps,
        "cpu_ms": 1e3 * cpu / steps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=64, help="concurrent requests")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--grammar-forced-drafts", type=int, default=8, metavar="K")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    llm = LLM(
        str(DEFAULT_MODEL_DIR),
        device="cpu",
        max_num_seqs=args.rows,
        max_num_tokens=8192,
        max_model_len=args.max_tokens + 64,
        async_scheduling=True,
        decode_steps=1,
        grammar_forced_drafts=args.grammar_forced_drafts,
    )
    drafter = llm.engine.grammar_drafts
    gen = stub_forward(llm)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 4000) for _ in range(16)] for _ in range(args.rows)]
    base = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens) for i in range(args.rows)]
    constrained = [
        p.clone(structured_outputs=StructuredOutputsParams(json=schema_for(i, rng)))
        for i, p in enumerate(base)
    ]
    if drafter is not None:
        drafter.enabled = False  # the plain constrained runs; the drafts have their own
    timed_run(llm, prompts, constrained)  # compiles the grammars
    gen.manual_seed(0)
    first = timed_run(llm, prompts, constrained)  # the lengths every constrained run repeats
    matched = [
        p.clone(ignore_eos=True, max_tokens=max(1, len(o.outputs[0].token_ids)))
        for p, o in zip(base, first["outs"])
    ]
    runs: dict[str, list[dict]] = {"unconstrained": [], "constrained": []}
    if drafter is not None:
        runs["forced drafts"] = []
    for _ in range(args.repeats):  # alternated: drift in a shared machine hits both alike
        for name in runs:
            params = matched if name == "unconstrained" else constrained
            if drafter is not None:
                drafter.enabled = name == "forced drafts"
            gen.manual_seed(0)
            runs[name].append(timed_run(llm, prompts, params))
    figures = {"rows": args.rows}
    for name, rs in runs.items():
        figures[name] = {
            "steps": rs[0]["steps"],
            "tokens": rs[0]["tokens"],
            "wall_ms_per_step": statistics.mean(r["wall_ms"] for r in rs),
            "cpu_ms_per_step": statistics.mean(r["cpu_ms"] for r in rs),
            "cpu_ms_per_token": statistics.mean(r["cpu_ms"] * r["steps"] / r["tokens"] for r in rs),
        }
    free, so = figures["unconstrained"], figures["constrained"]
    print(f"{args.rows} rows, stub forward; host ms per step (wall / process CPU)")
    for name in runs:
        f = figures[name]
        print(
            f"  {name:<14} {f['wall_ms_per_step']:7.2f} / {f['cpu_ms_per_step']:7.2f}  "
            f"({f['steps']} steps, {f['tokens']} tokens; {f['cpu_ms_per_token']:.3f} CPU ms a token)"
        )
    added_wall = so["wall_ms_per_step"] - free["wall_ms_per_step"]
    added_cpu = so["cpu_ms_per_step"] - free["cpu_ms_per_step"]
    print(
        f"  added          {added_wall:7.2f} / {added_cpu:7.2f}  "
        f"({100 * added_cpu / free['cpu_ms_per_step']:.1f} % of the unconstrained CPU time)"
    )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
