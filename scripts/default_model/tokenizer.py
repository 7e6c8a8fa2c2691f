"""Byte-level BPE tokenizer of the default model, its chat template, and its HF files.

The tokenizer adds the BOS token (<|endoftext|>, also EOS) in front of every encoded text; the
chat template writes it itself, so chat prompts are encoded with add_special_tokens=False.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOT = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [EOT, PAD, "<|system|>", "<|user|>", "<|assistant|>"]
BOS_ID = 0  # the index of EOT in SPECIAL_TOKENS, which the trainer assigns first
PAD_ID = 1

# Kept on one line with explicit "\n" so the rendered text has no stray whitespace.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on texts (multi-threaded inside `tokenizers`)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.token_to_id(EOT) != BOS_ID or tok.token_to_id(PAD) != PAD_ID:
        raise RuntimeError("special tokens did not get the expected ids")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, BOS_ID)]
    )
    return tok


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Render messages with CHAT_TEMPLATE exactly as transformers' apply_chat_template does."""
    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    return template.render(messages=messages, bos_token=EOT, eos_token=EOT,
                           add_generation_prompt=add_generation_prompt)


def encode_documents(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, BOS first (the batch call runs on all cores)."""
    return [[BOS_ID, *enc.ids] for enc in tok.encode_batch(texts, add_special_tokens=False)]


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json and a tokenizer_config.json that AutoTokenizer understands."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": SPECIAL_TOKENS[2:],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": EOT, "eos_token": EOT, "pad_token": PAD}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
