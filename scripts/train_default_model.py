"""Train slipstream's embedded default model and its draft model on the Python stdlib.

Reproducible and seeded; see scripts/default_model/ for the parts. On one H200 the whole run
(tokenizer, both models, evaluation) takes a few minutes:

    python scripts/train_default_model.py --output-dir /tmp/models --archive $OUT/models.tar.gz
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_model.pipeline import run  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output-dir", required=True, help="gets default_model/, draft_model/, "
                   "metrics.json")
    p.add_argument("--archive", help="also write one .tar.gz with both models + metrics")
    p.add_argument("--tiny", action="store_true", help="CPU smoke scale: few files, tiny models")
    p.add_argument("--time-budget-target", type=float, default=240.0, help="seconds")
    p.add_argument("--time-budget-draft", type=float, default=100.0, help="seconds")
    p.add_argument("--target-steps", type=int, help="fixed step count (else planned)")
    p.add_argument("--draft-steps", type=int, help="fixed step count (else planned)")
    p.add_argument("--max-epochs-target", type=float, default=40.0,
                   help="step cap; the decay usually starts earlier, when validation stalls")
    p.add_argument("--max-epochs-draft", type=float, default=40.0)
    p.add_argument("--lr-target", type=float, default=2e-3)
    p.add_argument("--lr-draft", type=float, default=3e-3)
    p.add_argument("--draft-distill", type=float, default=0.5,
                   help="share of the draft's loss that is KL to the target (0: plain LM)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--chat-examples", type=int, default=1500,
                   help="chat-formatted (docstring -> function) examples added to the corpus")
    p.add_argument("--quality-prompts", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--include-tests", action="store_true",
                   help="also train on the stdlib's test directories (more data)")
    p.add_argument("--stdlib", help="corpus root (default: this Python's stdlib)")
    p.add_argument("--device", help="cuda / cpu (default: cuda when available)")
    p.add_argument("--compile", action="store_true", help="torch.compile the models")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.tiny:  # a pipeline check in seconds on a CPU, not a useful model
        args.vocab_size = min(args.vocab_size, 512)
        args.seq_len = min(args.seq_len, 64)
        args.batch_size = min(args.batch_size, 8)
        args.target_steps = args.target_steps or 20
        args.draft_steps = args.draft_steps or 20
        args.chat_examples = min(args.chat_examples, 20)
        args.quality_prompts = min(args.quality_prompts, 4)
        args.max_new_tokens = min(args.max_new_tokens, 16)
    return args


def main(argv: list[str] | None = None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
