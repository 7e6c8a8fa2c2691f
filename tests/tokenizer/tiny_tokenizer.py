"""A tiny byte-level BPE tokenizer saved as a Hugging Face tokenizer directory.

Byte-level, so every byte has its own token: random id sequences split multi-byte characters,
which is what the detokenizer tests need. Other tests may reuse `make_tiny_tokenizer`.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "Les élèves étudient à l'école; naïve café déjà vu.",
    "你好世界，今天天气很好。我们一起学习中文。",
    "emoji time 😀😃🎉🚀 and 👍🏽 thumbs, 🇫🇷 flags",
    "def main():\n    return 42  # code too\n",
]


def make_tiny_tokenizer(
    path: Path, add_bos: bool = True, chat_template: bool = True, eos_extra: int | None = None
) -> Path:
    """Train and save the tokenizer in `path`; returns `path`.

    add_bos: the tokenizer adds <s> in encode (Llama style) or nothing (Qwen style).
    eos_extra: also write generation_config.json naming this id as a second EOS.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 10, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|end|>"],
    )
    if chat_template:
        hf.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(path))
    if eos_extra is not None:
        gen = {"eos_token_id": [eos_extra, hf.eos_token_id]}
        (path / "generation_config.json").write_text(json.dumps(gen))
    return path


def byte_token_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte of text (splits every multi-byte character)."""
    vocab = tokenizer.hf.get_vocab()
    table = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    assert set(byte_to_char.values()) == set(table)
    return [vocab[byte_to_char[b]] for b in text.encode("utf-8")]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the ByteLevel alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}
