"""Speculative methods without extra training on real text (one GPU, ~1-2 min; runs on CPU too).

The default model (a small Python code model trained on the standard library) continues its
held-out standard library files (never trained on; slipstream's own sources where the
standard library is absent) at temperature 0, batch 1 and 8. Per method: tokens/s against no
speculation in the same engine and run, the acceptance rate, the mean accepted length (tokens
a verification emits) and tokens per target step (every emitted token over verifications plus
plain decode steps: what the speed-up is made of). "exact" compares the tokens with the run
without speculation (in bfloat16 a verification chunk and a decode step may round a near tie
differently).

    python benchmarks/bench_spec_methods.py [--batches 1,8] [--output-len 128] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import time
from pathlib import Path

from transformers import AutoTokenizer

from slipstream import LLM, SamplingParams
from slipstream.assets import DEFAULT_MODEL_DIR, DEFAULT_MODEL_HELDOUT_FILES

METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "lookahead": {"method": "lookahead", "num_speculative_tokens": 4},
    "lookahead k6": {
        "method": "lookahead",
        "num_speculative_tokens": 6,
        "lookahead_window": 6,
        "lookahead_ngram": 7,
        "lookahead_candidates": 4,
    },
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4},
}


def _sources() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    held_out = [stdlib / f for f in DEFAULT_MODEL_HELDOUT_FILES if (stdlib / f).is_file()]
    return held_out or sorted((Path(__file__).resolve().parents[1] / "slipstream").glob("*/*.py"))


def _prompts(batch: int, input_len: int) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    prompts = []
    for path in _sources():
        ids = tok(path.read_text())["input_ids"]
        if len(ids) >= input_len:
            prompts.append(ids[:input_len])
        if len(prompts) == batch:
            return prompts
    raise SystemExit(f"not {batch} source files of {input_len} tokens")


def _run(llm: LLM, prompts, params) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    ids = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, ids)) / wall, ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="the model's own (bfloat16) unless given")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results/spec_methods")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    kw = dict(max_num_seqs=max(batches), max_model_len=args.input_len + args.output_len + 16)
    for key in ("device", "dtype"):
        if getattr(args, key):
            kw[key] = getattr(args, key)
    rows = []
    for name, spec in METHODS.items():
        llm = LLM(DEFAULT_MODEL_DIR, speculative_config={**spec, "adaptive": False}, **kw)
        decoder = llm.engine.spec
        for b in batches:
            prompts = _prompts(b, args.input_len)
            # Each warm-up is the timed run itself: the kernel variants a run's step shapes need
            # (draft trees vary per step) compile there, not in the measurement.
            decoder.enabled = False
            _run(llm, prompts, params)
            base, want = _run(llm, prompts, params)
            decoder.enabled = True
            _run(llm, prompts, params)
            decoder.stats = type(decoder.stats)()
            rate, got = _run(llm, prompts, params)
            s = decoder.stats.as_dict()
            total = sum(map(len, got))
            steps = s["num_drafts"] + total - s["num_drafts"] * s["mean_accepted_length"]
            row = {
                "method": name,
                "batch": b,
                "baseline_tok_s": base,
                "tok_s": rate,
                "speedup": rate / base,
                "same_tokens": got == want,
                "acceptance_rate": s["acceptance_rate"],
                "mean_accepted_length": s["mean_accepted_length"],
                "tokens_per_step": total / steps,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        del llm
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec_methods.json").write_text(json.dumps(rows, indent=1))
    print(
        "\n| method | batch | no spec tok/s | tok/s | speed-up | acceptance | mean accepted | tokens/step ",
        end="",
    )
    print("| exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['batch']} | {r['baseline_tok_s']:.0f} | {r['tok_s']:.0f} | "
            f"{r['speedup']:.2f}x | {r['acceptance_rate']:.2f} | {r['mean_accepted_length']:.2f} | "
            f"{r['tokens_per_step']:.2f} | {r['same_tokens']} |"
        )


if __name__ == "__main__":
    main()
