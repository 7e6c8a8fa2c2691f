"""Beam search throughput against greedy decoding of the same requests, in one process.

    python benchmarks/bench_beam_search.py [--model DIR] [--num-requests 256] [--input-len 128]
        [--output-len 128] [--beam-width 4] [--max-num-seqs N]
Random prompts, EOS ignored so every request runs output_len tokens. Greedy: one sequence per
request, for num_requests requests and again for num_requests * beam_width requests (as many
sequences as the beams); beam search: beam_width beams per request (engine/beam.py). The engine
holds every beam at once (max_num_seqs defaults to num_requests * beam_width). Prints wall
time, output tokens per second (best sequence per request) and beam tokens per second (every
beam's tokens), and beam tokens per second over greedy's at the same number of sequences.
"""
from __future__ import annotations

import argparse
import json
import random
import time

from slipstream import LLM, SamplingParams
from slipstream.assets import default_model_path
from slipstream.sampling.beam_search import BeamSearchParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the embedded model)")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="default: num_requests * beam_width (every beam at once)")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    num_seqs = args.num_requests * args.beam_width
    llm = LLM(args.model or str(default_model_path()), max_num_seqs=args.max_num_seqs or num_seqs,
              max_num_tokens=8192)
    vocab = llm.engine_config.model.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(num_seqs)]
    llm.generate(prompts[:8], SamplingParams(max_tokens=8), use_tqdm=False)  # warm
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rows = []
    for count in (args.num_requests, num_seqs):
        start = time.perf_counter()
        llm.generate(prompts[:count], greedy, use_tqdm=False)
        secs = time.perf_counter() - start
        tokens = count * args.output_len
        rows.append((f"greedy {count}", secs, tokens / secs, tokens / secs))
    prompts = prompts[: args.num_requests]
    tokens = args.num_requests * args.output_len
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.output_len,
                              ignore_eos=True)
    start = time.perf_counter()
    outs = llm.beam_search(prompts, params)
    beam_s = time.perf_counter() - start
    assert all(len(o.sequences[0].output_token_ids) == args.output_len for o in outs)
    rows.append((f"beam x{args.beam_width}", beam_s, tokens / beam_s,
                 tokens * args.beam_width / beam_s))
    print(f"{args.num_requests} requests, {args.input_len} in / {args.output_len} out")
    print(f"{'mode':<12} {'wall s':>8} {'out tok/s':>11} {'beam tok/s':>11}")
    for name, secs, tps, beam_tps in rows:
        print(f"{name:<12} {secs:8.2f} {tps:11.0f} {beam_tps:11.0f}")
    print(f"beam search: {rows[2][3] / rows[1][2]:.0%} of greedy's tok/s at {num_seqs} sequences, "
          f"{rows[2][1] / rows[0][1]:.2f}x the wall time of greedy at {args.num_requests}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([dict(zip(("mode", "wall_s", "out_tok_s", "beam_tok_s"), r)) for r in rows],
                      f, indent=1)


if __name__ == "__main__":
    main()
