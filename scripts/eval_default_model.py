"""Evaluate a default-model checkpoint (and its draft) on the held-out stdlib files.

    python scripts/eval_default_model.py --model slipstream/assets/default_model \\
        --draft slipstream/assets/draft_model

Prints held-out perplexity, the `ast` quality check with three examples, and the draft's greedy
agreement with the target; --json writes them to a file. Deterministic (greedy, fp32).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_model import corpus, evaluate  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="target checkpoint directory")
    p.add_argument("--draft", help="draft checkpoint directory (adds the agreement check)")
    p.add_argument("--quality-prompts", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--max-files", type=int, help="only the first N held-out files (tests)")
    p.add_argument("--stdlib", help="corpus root (default: this Python's stdlib)")
    p.add_argument("--device", help="cuda / cpu (default: cuda when available)")
    p.add_argument("--json", help="write the results here")
    return p


def _print_quality(name: str, q: dict) -> None:
    print(f"{name}: {q['num_parse']}/{q['num_prompts']} completions parse "
          f"({100 * q['fraction']:.1f} %)")
    for r in q["results"][:3]:
        print(f"--- {r['file']} :: {r['name']} ({'parses' if r['parses'] else 'fails'})")
        print(r["prompt"] + r["completion"])


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    names = corpus.HELDOUT_FILES[: args.max_files] if args.max_files else corpus.HELDOUT_FILES
    files, missing = corpus.load_heldout(Path(args.stdlib) if args.stdlib else None, names)
    if missing:
        print(f"held-out files missing on this Python: {missing}")
    prompts = evaluate.signature_prompts(files, args.quality_prompts)
    results: dict = {"heldout_files": [f.rel_path for f in files]}
    models = {"target": args.model, **({"draft": args.draft} if args.draft else {})}
    loaded = {}
    for role, path in models.items():
        model, tok = evaluate.load_checkpoint(path, device)
        loaded[role] = model
        ppl = evaluate.perplexity(model, tok, files, args.seq_len)
        quality = evaluate.quality_check(model, tok, prompts, args.max_new_tokens)
        results[role] = {"heldout": ppl, "quality": quality}
        print(f"{role}: held-out perplexity {ppl['perplexity']:.4f} "
              f"({ppl['tokens']:,} tokens, {ppl['bits_per_byte']:.4f} bits/byte)")
        _print_quality(role, quality)
    if "draft" in loaded:
        results["agreement"] = evaluate.draft_agreement(
            loaded["target"], loaded["draft"], tok, files, args.seq_len)
        print(f"draft greedy agreement with target: "
              f"{100 * results['agreement']['agreement']:.2f} %")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
