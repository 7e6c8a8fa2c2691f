"""How early a streamed beam search shows text: time to the first settled token against time to
the result, and the share of each returned hypothesis settled before the search ended.

    python benchmarks/bench_beam_streaming.py [--model DIR] [--num-requests 64]
        [--input-len 128] [--output-len 128] [--beam-width 4]

All searches start together on one engine (EngineCore), as a server's concurrent streams would;
after each step the newly settled tokens (`beams.take_progress()`, what the server streams) are
timed. Random prompts, EOS ignored.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from slipstream import LLM, SamplingParams
from slipstream.assets import default_model_path
from slipstream.sampling.beam_search import BeamSearchParams


def _p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--beam-width", type=int, default=4)
    args = ap.parse_args()
    llm = LLM(args.model or str(default_model_path()), max_num_seqs=256, max_num_tokens=8192)
    llm.generate([[11, 12, 13]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm
    vocab = llm.engine_config.model.vocab_size
    rng = random.Random(0)
    engine = llm.engine
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.output_len, ignore_eos=True)
    start = time.perf_counter()
    for i in range(args.num_requests):
        prompt = [rng.randrange(10, vocab) for _ in range(args.input_len)]
        engine.add_beam_search(f"s{i}", prompt, params, ())
    first: dict[str, float] = {}
    settled: dict[str, int] = {}
    done: dict[str, float] = {}
    results = {}
    while engine.has_unfinished_requests():
        engine.step()
        now = time.perf_counter() - start
        for sid, tokens in engine.beams.take_progress().items():
            first.setdefault(sid, now)
            settled[sid] = settled.get(sid, 0) + len(tokens)
        for sid, out in engine.beams.take_finished().items():
            done[sid] = now
            results[sid] = out
    ids = sorted(done)
    ttfs = [first.get(s, done[s]) for s in ids]
    share = [settled.get(s, 0) / len(results[s].sequences[0].output_token_ids) for s in ids]
    print(
        f"{args.num_requests} beam searches x{args.beam_width}, {args.input_len} in / "
        f"{args.output_len} out, started together"
    )
    print(f"{'metric':<34} {'mean':>8} {'p50':>8} {'p90':>8}")
    rows = [
        ("time to first settled token (s)", ttfs),
        ("time to result (s)", [done[s] for s in ids]),
        ("share settled before the end", share),
    ]
    for name, values in rows:
        print(f"{name:<34} {statistics.mean(values):8.3f} {_p(values, 0.5):8.3f} {_p(values, 0.9):8.3f}")
    print(f"searches with text before the end: {sum(1 for s in ids if s in first)}/{len(ids)}")


if __name__ == "__main__":
    main()
