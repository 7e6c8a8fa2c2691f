"""Model card (README.md) of each shipped model directory, generated from the metrics JSON."""

from __future__ import annotations

from .corpus import CORPUS_LICENSE

TITLES = {"target": "slipstream default model (target)",
          "draft": "slipstream default draft model"}
EVAL_CMD = ("python scripts/eval_default_model.py --model slipstream/assets/default_model "
            "--draft slipstream/assets/draft_model")


def _arch(cfg: dict) -> str:
    return (f"`LlamaForCausalLM`: {cfg['num_hidden_layers']} layers, hidden size "
            f"{cfg['hidden_size']}, {cfg['num_attention_heads']} attention heads "
            f"({cfg['num_key_value_heads']} KV heads, head dim {cfg['head_dim']}), MLP "
            f"{cfg['intermediate_size']}, vocabulary {cfg['vocab_size']}, tied embeddings, "
            f"RoPE, context {cfg['max_position_embeddings']} tokens, weights in bfloat16")


def _training(m: dict, role: str) -> str:
    t = m[role]["train"]
    hw = m["hardware"]
    return "\n".join([
        f"- Hardware: {hw['device']} ({hw['torch']}, transformers {hw['transformers']})",
        f"- Training time: {t['train_seconds']:.0f} s, {t['steps']} steps of "
        f"{m['settings'][role]['batch_size']} x {m['settings'][role]['seq_len']} tokens "
        f"({t['tokens_seen'] / 1e6:.1f} M tokens, {t['epochs']:.1f} epochs, "
        f"{t['tokens_per_second'] / 1e6:.2f} M tokens/s)",
        f"- Optimizer: AdamW (peak lr {m['settings'][role]['lr']}, cosine to 10 %, "
        f"weight decay 0.1), bf16 autocast, seed {m['seed']}",
        f"- Final training loss: {t['final_train_loss']:.4f}; best validation loss "
        f"{t['best_val_loss']:.4f} (weights kept from step {t['best_step']})",
    ])


def _results(m: dict, role: str) -> str:
    rows = ["| model | parameters | held-out loss | held-out perplexity | bits per byte |",
            "|---|---|---|---|---|"]
    for name in ("target", "draft"):
        if name in m:
            e = m[name]["heldout"]
            rows.append(f"| {name} | {m[name]['train']['params']:,} | {e['loss']:.4f} | "
                        f"{e['perplexity']:.3f} | {e['bits_per_byte']:.4f} |")
    q = m[role]["quality"]
    lines = ["\n".join(rows), "",
             f"Held-out set: {m['target']['heldout']['tokens']:,} tokens, non-overlapping "
             f"{m['settings']['target']['seq_len']}-token windows per file.", "",
             f"**Quality check ({role} model):** greedy completions of {q['num_prompts']} held-out function "
             f"signatures, cut at the first blank line (or the first line back at column 0): "
             f"**{q['num_parse']} / {q['num_prompts']}** parse with `ast`."]
    if "agreement" in m:
        a = m["agreement"]
        lines.append(f"\n**Draft agreement:** the draft's greedy next token equals the target's "
                     f"on {100 * a['agreement']:.1f} % of {a['positions']:,} held-out positions "
                     f"(the per-token acceptance rate of greedy speculative decoding).")
    lines.append(f"\nReproduce: `{EVAL_CMD}` (on Python {m['python']}).")
    return "\n".join(lines)


def _examples(m: dict, role: str) -> str:
    parts = ["The first three prompts of the fixed evaluation order (not cherry-picked):"]
    for r in m[role]["quality"]["results"][:3]:
        status = "parses" if r["parses"] else "does not parse"
        parts.append(f"\n`{r['file']}` — `{r['name']}` ({status}):\n\n```python\n"
                     f"{r['prompt']}{r['completion']}\n```")
    return "\n".join(parts)


def render_card(m: dict, role: str) -> str:
    """The README.md of the target ("target") or draft ("draft") model directory."""
    c = m["corpus"]
    heldout = ", ".join(f"`{p}`" for p in c["heldout_files"])
    missing = f" (missing on this Python: {', '.join(c['heldout_missing'])})" \
        if c["heldout_missing"] else ""
    role_line = ("The default model of slipstream, used wherever `--model` / `model=` is omitted."
                 if role == "target" else
                 "The draft model of slipstream's default model, for speculative decoding; it "
                 "shares the target's tokenizer.")
    return "\n".join([
        f"# {TITLES[role]}", "", role_line,
        "A tiny Python code model trained from scratch by `scripts/train_default_model.py`; "
        "it completes Python code and is meant for demos, tests and benchmarks, not for real "
        "work.", "",
        "## Architecture", "", _arch(m[role]["config"]) + ".",
        f"Parameters: {m[role]['train']['params']:,}.", "",
        "## Training data", "",
        f"The Python {m['python']} standard library (`*.py` under `{c['root']}`, without "
        f"test directories, site-packages, generated and very large files): "
        f"{c['train_files']} training files ({c['train_bytes'] / 1e6:.1f} MB, "
        f"{c['train_tokens']:,} tokens with {c['chat_examples']} chat examples built from "
        f"documented functions), {c['validation_files']} validation files (early stopping).",
        f"Licence of the corpus: {CORPUS_LICENSE}.", "",
        f"Held-out files ({len(c['heldout_files'])}){missing}: {heldout}.", "",
        "## Tokenizer", "",
        f"Byte-level BPE, {m['tokenizer']['vocab_size']} tokens, "
        f"{m['tokenizer']['bytes_per_token']:.2f} bytes per token on the training set; "
        "`<|endoftext|>` is BOS and EOS; chat template with `<|system|>`, `<|user|>`, "
        "`<|assistant|>`.", "",
        "## Training", "", _training(m, role), "",
        "## Evaluation", "", _results(m, role), "",
        "## Examples", "", _examples(m, role), "",
    ])
