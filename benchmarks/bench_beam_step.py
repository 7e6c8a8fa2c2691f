"""Where a beam-search step's time goes, against a greedy step over as many sequences.

    python benchmarks/bench_beam_step.py [--model DIR] [--num-requests 256] [--beam-width 4]
        [--input-len 128] [--output-len 32]
One engine with decode_steps=1, so a greedy step and a beam step do the same model work:
num_requests * beam_width greedy sequences, then num_requests searches of beam_width beams.
The engine's step timer (engine/step_timer.py) splits each step into schedule, prepare,
forward / graph, sample, update and beam (the search's choice, forks and block copies); its
device syncs perturb the run, so read the split, and bench_beam_search.py for throughput.
First, host only: the choice of the next beams for num_requests searches, one search at a
time (`BeamSearchState.step`) against all at once (`step_many`).
"""

from __future__ import annotations

import argparse
import random
import time

from slipstream import LLM, SamplingParams
from slipstream.assets import default_model_path
from slipstream.sampling.beam_search import BeamSearchParams, BeamSearchState, step_many


def timed(llm: LLM, run) -> tuple[float, dict[str, float]]:
    timer = llm.engine.timer
    timer.totals.clear()
    timer.counts.clear()
    timer.enabled = True
    start = time.perf_counter()
    run()
    wall = time.perf_counter() - start
    timer.enabled = False
    return wall, dict(timer.totals)


def choice_ms(num_searches: int, width: int, vocab: int, steps: int = 20) -> tuple[float, float]:
    """Milliseconds a step for the next-beam choice of num_searches searches: one by one, and
    vectorized, from random packed logprob rows (as the sampler hands them over)."""
    rng = random.Random(0)
    params = BeamSearchParams(beam_width=width, max_tokens=steps + 2, ignore_eos=True)
    k = params.num_candidates(0)

    def rows():
        out = []
        for _ in range(num_searches):
            beams = []
            for _ in range(width):
                vals = sorted((-rng.random() * 5 for _ in range(k)), reverse=True)
                beams.append([0.0, vals[0], *map(float, rng.sample(range(vocab), k)), *vals])
            out.append(beams)
        return out

    def run(vectorized: bool) -> float:
        states = [BeamSearchState(params) for _ in range(num_searches)]
        step_many(states, [r[:1] for r in rows()])  # one beam each -> width beams each
        total = 0.0
        for _ in range(steps):
            batch = rows()
            start = time.perf_counter()
            if vectorized:
                step_many(states, batch)
            else:
                for state, beams in zip(states, batch):
                    state.step([list(zip(map(int, r[2 : 2 + k]), r[2 + k :])) for r in beams])
            total += time.perf_counter() - start
        return 1e3 * total / steps

    return run(False), run(True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    one, many = choice_ms(args.num_requests, args.beam_width, 32000)
    print(
        f"choice of the next beams, {args.num_requests} searches of {args.beam_width}: "
        f"{one:.2f} ms a step one by one, {many:.2f} ms with step_many"
    )
    num_seqs = args.num_requests * args.beam_width
    llm = LLM(
        args.model or str(default_model_path()),
        max_num_seqs=num_seqs,
        max_num_tokens=max(8192, num_seqs),
        decode_steps=1,
    )
    vocab = llm.engine_config.model.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(num_seqs)]
    llm.generate(prompts[:8], SamplingParams(max_tokens=4), use_tqdm=False)  # warm
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    beam = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.output_len, ignore_eos=True)
    rows = [
        ("greedy", *timed(llm, lambda: llm.generate(prompts, greedy, use_tqdm=False))),
        (
            f"beam x{args.beam_width}",
            *timed(llm, lambda: llm.beam_search(prompts[: args.num_requests], beam)),
        ),
    ]
    phases = ["schedule", "prepare", "forward", "graph", "sample", "update", "beam"]
    print(
        f"{num_seqs} sequences, {args.input_len} in / {args.output_len} out, "
        f"ms per output step (all sequences)"
    )
    print(f"{'mode':<8} {'wall ms':>8}" + "".join(f" {p:>8}" for p in phases))
    for name, wall, totals in rows:
        per = 1e3 / args.output_len
        print(f"{name:<8} {wall * per:8.2f}" + "".join(f" {totals.get(p, 0.0) * per:8.2f}" for p in phases))


if __name__ == "__main__":
    main()
