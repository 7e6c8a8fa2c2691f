"""The host's grammar work in one decode step with N constrained requests, part by part.

Each request has its own JSON schema (bench_structured.py's), compiled against the model's
vocabulary. A step: advance every matcher over its last token (accept_token), fill the rows'
token bitmasks, copy the mask to the logits' device, apply it to the logits. Each part is timed
one request at a time and in xgrammar's batched calls, and the copy into a new tensor and into
a preallocated one.

    python benchmarks/bench_structured_step.py [--model PATH] [--rows 8 64 256] [--steps 50]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from functools import partial

import torch

from benchmarks.bench_structured import schema_for
from slipstream.structured.bitmask import apply_bitmask, bitmask_words
from slipstream.structured.manager import StructuredOutputManager
from slipstream.structured.params import StructuredOutputsParams


def matchers_for(manager: StructuredOutputManager, rows: int) -> list:
    import xgrammar as xgr

    rng = random.Random(0)
    compiled = [
        manager.compile(StructuredOutputsParams(json=schema_for(i, rng))).result() for i in range(rows)
    ]
    return [xgr.GrammarMatcher(c) for c in compiled]


def allowed_token(mask_row: torch.Tensor, vocab: int, rng: random.Random) -> int:
    bits = (mask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    ids = bits.flatten()[:vocab].nonzero().flatten().tolist()
    return rng.choice(ids)


def accept_each(matchers: list, tokens: list[int]) -> None:
    for matcher, token in zip(matchers, tokens, strict=True):
        matcher.accept_token(token)


def timed(fn, sync) -> float:
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def run(manager, vocab: int, rows: int, steps: int, device: torch.device) -> dict[str, float]:
    import xgrammar as xgr

    matchers = matchers_for(manager, rows)
    words = bitmask_words(vocab)
    pin = device.type == "cuda"
    host = torch.empty(rows, words, dtype=torch.int32, pin_memory=pin)
    on_device = torch.empty(rows, words, dtype=torch.int32, device=device)
    logits = torch.randn(rows, vocab, device=device)
    batch = xgr.BatchGrammarMatcher()
    index = list(range(rows))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rng = random.Random(1)
    parts = {
        k: 0.0
        for k in (
            "fill_loop",
            "fill_batch",
            "accept_loop",
            "accept_batch",
            "copy_new",
            "copy_prealloc",
            "apply",
        )
    }
    done = 0
    for _ in range(steps):
        if any(m.is_terminated() for m in matchers):
            break
        step_parts = {
            "fill_loop": lambda: [m.fill_next_token_bitmask(host, i) for i, m in enumerate(matchers)],
            "fill_batch": lambda: batch.batch_fill_next_token_bitmask(matchers, host, indices=index),
            "copy_new": lambda: host.to(device, non_blocking=True),
            "copy_prealloc": lambda: on_device.copy_(host, non_blocking=True),
            "apply": lambda: apply_bitmask(logits, on_device, index),
        }
        for name, fn in step_parts.items():
            parts[name] += timed(fn, sync)
        tokens = [allowed_token(host[i], vocab, rng) for i in range(rows)]
        # Each token is accepted once: half the rows one request at a time, half batched.
        half = rows // 2
        loop, batched = matchers[:half], matchers[half:]
        parts["accept_loop"] += 2 * timed(partial(accept_each, loop, tokens[:half]), sync)
        parts["accept_batch"] += 2 * timed(partial(batch.batch_accept_token, batched, tokens[half:]), sync)
        done += 1
    return {k: 1e3 * v / max(done, 1) for k, v in parts.items()} | {"steps": done}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="a model directory with a tokenizer (default: the demo model)"
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    from slipstream.assets import DEFAULT_MODEL_DIR

    path = args.model or str(DEFAULT_MODEL_DIR)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    manager = StructuredOutputManager(path, vocab)
    device = torch.device(args.device)
    print(f"device {device}, vocab {vocab}; ms per step")
    head = [
        "rows",
        "steps",
        "fill_loop",
        "fill_batch",
        "accept_loop",
        "accept_batch",
        "copy_new",
        "copy_prealloc",
        "apply",
    ]
    print("  ".join(f"{h:>13}" for h in head))
    for rows in args.rows:
        r = run(manager, vocab, rows, args.steps, device)
        print("  ".join([f"{rows:>13}", f"{r['steps']:>13}"] + [f"{r[h]:>13.3f}" for h in head[2:]]))
    manager.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
