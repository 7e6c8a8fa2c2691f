"""The tokenizer of a GGUF file: vocabulary, merges, special tokens and chat template from its
metadata, converted by transformers' own GGUF support (no remote code, no network); EOS ids
also include llama.cpp's end-of-turn tokens.
"""
from __future__ import annotations

from pathlib import Path

from slipstream.models.gguf import GGUF_SUFFIX, eos_token_ids, is_gguf_file
from slipstream.tokenizer.tokenizer import Tokenizer

# A directory holding any of these is a Hugging Face tokenizer, whatever else it holds.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def gguf_tokenizer_file(path: str | Path | None) -> Path | None:
    """The GGUF file that holds the tokenizer at `path`: the file itself, or the only .gguf
    file of a directory without Hugging Face tokenizer files; else None."""
    if path is None:
        return None
    p = Path(path)
    if is_gguf_file(p):
        return p
    if not p.is_dir() or any((p / f).is_file() for f in HF_TOKENIZER_FILES):
        return None
    found = [f for f in p.iterdir() if f.name.lower().endswith(GGUF_SUFFIX) and f.is_file()]
    return found[0] if len(found) == 1 else None


def load_gguf_tokenizer(path: str | Path) -> Tokenizer:
    from transformers import PreTrainedTokenizerFast

    p = Path(path)
    try:
        hf = PreTrainedTokenizerFast.from_pretrained(
            str(p.parent), gguf_file=p.name, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"could not build a tokenizer from the GGUF file {p}: {exc}") from exc
    eos = list(eos_token_ids(p))
    if hf.eos_token_id is not None:
        eos.append(hf.eos_token_id)
    return Tokenizer(hf, tuple(dict.fromkeys(int(i) for i in eos)), str(p))
