"""The whole default-model pipeline: corpus -> tokenizer -> target -> draft -> evaluation.

Each model is saved as a Hugging Face checkpoint directory (bfloat16 safetensors, tokenizer,
generation config, model card); metrics go to one JSON file, and optionally everything into
one tar archive (the device machine returns few files).
"""

from __future__ import annotations

import copy
import json
import platform
import sys
import tarfile
import time
from argparse import Namespace
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig

from . import corpus as corpus_mod
from . import evaluate, tokenizer
from .card import render_card
from .trainer import TrainSettings, fixed_windows, train_model

TARGET_DIR, DRAFT_DIR, METRICS_FILE = "default_model", "draft_model", "metrics.json"
MAX_POSITIONS = 1024


def model_config(role: str, vocab_size: int, tiny: bool) -> LlamaConfig:
    """Target: ~6.5 M parameters (13 MB in bf16); draft: ~0.8 M. Tiny: for CPU tests."""
    shapes = {  # hidden, layers, heads, kv heads, intermediate
        ("target", False): (256, 8, 8, 4, 640), ("draft", False): (128, 2, 4, 2, 256),
        ("target", True): (64, 2, 4, 2, 128), ("draft", True): (32, 1, 2, 1, 64),
    }
    hidden, layers, heads, kv_heads, inter = shapes[(role, tiny)]
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True, rms_norm_eps=1e-5,
        bos_token_id=tokenizer.BOS_ID, eos_token_id=tokenizer.BOS_ID,
        pad_token_id=tokenizer.PAD_ID,
    )


def _log(msg: str) -> None:
    print(msg, flush=True)


def prepare_data(args: Namespace, device: torch.device):
    """(corpus, trained tokenizer, train token tensor, validation windows, corpus metrics)."""
    t0 = time.perf_counter()
    corpus = corpus_mod.load_corpus(
        Path(args.stdlib) if args.stdlib else None,
        max_train_files=12 if args.tiny else None, include_tests=args.include_tests,
        heldout=corpus_mod.HELDOUT_FILES[:3] if args.tiny else corpus_mod.HELDOUT_FILES)
    pairs = corpus_mod.chat_examples(corpus.train, args.chat_examples)
    chats = [tokenizer.render_chat([{"role": "user", "content": q},
                                    {"role": "assistant", "content": a}]) for q, a in pairs]
    texts = [f.text for f in corpus.train]
    tok = tokenizer.train_tokenizer(texts + chats, args.vocab_size)
    t_tok = time.perf_counter() - t0
    docs = tokenizer.encode_documents(tok, texts)
    # chat texts carry their own BOS (the template writes it)
    chat_docs = [e.ids for e in tok.encode_batch(chats, add_special_tokens=False)]
    flat = [i for d in docs + chat_docs for i in d]
    train_ids = torch.tensor(flat, dtype=torch.long, device=device)
    val_flat = [i for d in tokenizer.encode_documents(tok, [f.text for f in corpus.validation])
                for i in d]
    val_windows = fixed_windows(torch.tensor(val_flat, device=device), args.seq_len,
                                16 if args.tiny else 256)
    file_tokens = sum(map(len, docs))
    metrics = {
        "root": corpus.root, "train_files": len(corpus.train),
        "train_bytes": corpus.train_bytes(), "train_tokens": len(flat),
        "chat_examples": len(chats), "validation_files": len(corpus.validation),
        "validation_tokens": len(val_flat), "include_tests": args.include_tests,
        "heldout_files": [f.rel_path for f in corpus.heldout],
        "heldout_missing": corpus.heldout_missing,
    }
    tok_metrics = {"vocab_size": tok.get_vocab_size(), "train_seconds": t_tok,
                   "bytes_per_token": corpus.train_bytes() / max(1, file_tokens - len(docs))}
    _log(f"[data] {len(corpus.train)} train files, {len(flat):,} tokens "
         f"({len(chats)} chat examples), {len(val_windows)} validation windows, "
         f"{len(corpus.heldout)} held-out files; tokenizer {t_tok:.1f}s, "
         f"{tok_metrics['bytes_per_token']:.2f} bytes/token")
    return corpus, tok, train_ids, val_windows, metrics, tok_metrics


def save_checkpoint(model, tok, out_dir: Path) -> None:
    """An ordinary HF checkpoint directory, weights in bfloat16."""
    out_dir.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out_dir)
    GenerationConfig(bos_token_id=tokenizer.BOS_ID, eos_token_id=tokenizer.BOS_ID,
                     pad_token_id=tokenizer.PAD_ID).save_pretrained(out_dir)
    tokenizer.save_hf_tokenizer(tok, out_dir, MAX_POSITIONS)


def settings_for(role: str, args: Namespace) -> TrainSettings:
    target = role == "target"
    return TrainSettings(
        name=role, seq_len=args.seq_len, seed=args.seed, compile=args.compile,
        time_budget_s=args.time_budget_target if target else args.time_budget_draft,
        lr=args.lr_target if target else args.lr_draft,
        batch_size=args.batch_size,
        max_epochs=args.max_epochs_target if target else args.max_epochs_draft,
        eval_every=10 if args.tiny else None,
        steps=args.target_steps if target else args.draft_steps,
        distill_weight=0.0 if target else args.draft_distill,
        warmup_steps=2 if args.tiny else 100, log_every=5 if args.tiny else 100,
        calib_steps=30,
    )


def hardware(device: torch.device) -> dict:
    if device.type == "cuda":
        name = f"1x {torch.cuda.get_device_name(device)}"
    else:
        name = f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    return {"device": name,
            "torch": f"torch {torch.__version__}", "transformers": transformers.__version__,
            "cuda": torch.version.cuda}


def evaluate_models(out: Path, corpus, args: Namespace, device: torch.device) -> dict:
    """Evaluate the saved (bf16) checkpoints, as shipped, in fp32 with transformers."""
    target, tok = evaluate.load_checkpoint(out / TARGET_DIR, device)
    draft, _ = evaluate.load_checkpoint(out / DRAFT_DIR, device)
    prompts = evaluate.signature_prompts(corpus.heldout, args.quality_prompts)
    result: dict = {}
    for role, model in (("target", target), ("draft", draft)):
        t = time.perf_counter()
        result[role] = {
            "heldout": evaluate.perplexity(model, tok, corpus.heldout, args.seq_len),
            "quality": evaluate.quality_check(model, tok, prompts, args.max_new_tokens),
        }
        r = result[role]
        _log(f"[eval] {role}: held-out ppl {r['heldout']['perplexity']:.3f}, "
             f"ast parse {r['quality']['num_parse']}/{r['quality']['num_prompts']} "
             f"({time.perf_counter() - t:.1f}s)")
    result["agreement"] = evaluate.draft_agreement(target, draft, tok, corpus.heldout,
                                                   args.seq_len)
    _log(f"[eval] draft agreement {result['agreement']['agreement']:.3f}")
    return result


def run(args: Namespace) -> dict:
    """Train and evaluate both models; write checkpoints, cards, metrics (and archive)."""
    t_start = time.perf_counter()
    transformers.logging.set_verbosity_error()  # no per-file "sequence too long" warnings
    transformers.utils.logging.disable_progress_bar()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.output_dir)
    corpus, tok, train_ids, val_windows, corpus_m, tok_m = prepare_data(args, device)
    m: dict = {"python": platform.python_version(), "seed": args.seed, "command": sys.argv,
               "hardware": hardware(device), "corpus": corpus_m, "tokenizer": tok_m,
               "settings": {}}
    teacher = None
    for role, dirname in (("target", TARGET_DIR), ("draft", DRAFT_DIR)):
        cfg = model_config(role, tok.get_vocab_size(), args.tiny)
        s = settings_for(role, args)
        model, stats = train_model(cfg, s, train_ids, val_windows, _log, teacher=teacher)
        m[role] = {"config": cfg.to_dict(), "train": vars(stats)}
        m["settings"][role] = vars(s)
        save_checkpoint(model, tok, out / dirname)
        # the fp32 target stays on the device to teach the draft
        teacher = model.requires_grad_(False) if args.draft_distill > 0 else None
    del teacher, model
    evaluation = evaluate_models(out, corpus, args, device)
    for role in ("target", "draft"):
        m[role].update(evaluation[role])
    m["agreement"] = evaluation["agreement"]
    m["total_seconds"] = time.perf_counter() - t_start
    write_outputs(m, out, args.archive)
    _log(f"[done] {m['total_seconds']:.1f}s total")
    return m


def write_outputs(m: dict, out: Path, archive: str | None) -> None:
    """metrics.json, a README.md model card in each model directory, and the archive."""
    (out / METRICS_FILE).write_text(json.dumps(m, indent=2, default=str) + "\n")
    (out / TARGET_DIR / "README.md").write_text(render_card(m, "target"))
    (out / DRAFT_DIR / "README.md").write_text(render_card(m, "draft"))
    sizes = {d: sum(f.stat().st_size for f in (out / d).iterdir()) for d in (TARGET_DIR, DRAFT_DIR)}
    _log(f"[save] sizes: {sizes} (total {sum(sizes.values()) / 1e6:.2f} MB)")
    if archive:
        Path(archive).parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive, "w:gz", compresslevel=6) as tar:
            for name in (TARGET_DIR, DRAFT_DIR, METRICS_FILE):
                tar.add(out / name, arcname=name)
        _log(f"[save] archive {archive}: {Path(archive).stat().st_size / 2**20:.2f} MiB")
