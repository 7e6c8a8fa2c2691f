"""Tiny random pooling checkpoints (saved with save_pretrained, float32) for the pooling tests."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

BERT_SHAPE = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64)


@torch.no_grad()
def save_tiny(model, path: Path) -> Path:
    gen = torch.Generator().manual_seed(7)
    for name, param in model.named_parameters():  # norms and biases away from 1 / 0
        if "norm" in name.lower() or name.endswith(".bias"):
            param.add_(0.2 * torch.randn(param.shape, generator=gen))
    model.float().eval().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BertConfig(**BERT_SHAPE)
    return save_tiny(transformers.BertModel(cfg), tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="session")
def tiny_bert_mean_dir(tiny_bert_dir, tmp_path_factory) -> Path:
    """The same BERT as a sentence-transformers checkpoint that mean-pools and normalises."""
    import shutil

    path = tmp_path_factory.mktemp("bert_st")
    shutil.copytree(tiny_bert_dir, path, dirs_exist_ok=True)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_cls_token": False,
         "pooling_mode_mean_tokens": True}))
    return path


@pytest.fixture(scope="session")
def tiny_bert_cls_dir(tmp_path_factory) -> Path:
    import transformers

    torch.manual_seed(1)
    cfg = transformers.BertConfig(**BERT_SHAPE, num_labels=3)
    return save_tiny(transformers.BertForSequenceClassification(cfg),
                     tmp_path_factory.mktemp("bert_cls"))


@pytest.fixture(scope="session")
def tiny_qwen3_embed_dir(tmp_path_factory) -> Path:
    """A headless Qwen3Model (names without `model.`), declared Matryoshka."""
    import transformers

    from tests.helpers import tiny_config

    torch.manual_seed(2)
    cfg = tiny_config("Qwen3ForCausalLM")
    cfg.architectures = ["Qwen3Model"]
    cfg.is_matryoshka = True
    return save_tiny(transformers.Qwen3Model(cfg), tmp_path_factory.mktemp("qwen3_embed"))


@pytest.fixture(scope="session")
def tiny_llama_cls_dir(tmp_path_factory) -> Path:
    """LlamaForSequenceClassification with one label (a cross-encoder) and a tokenizer."""
    import transformers

    from tests.helpers import tiny_config
    from tests.tokenizer.tiny_tokenizer import make_tiny_tokenizer

    torch.manual_seed(3)
    cfg = tiny_config("LlamaForCausalLM", num_labels=1, pad_token_id=0)
    cfg.architectures = ["LlamaForSequenceClassification"]
    path = save_tiny(transformers.LlamaForSequenceClassification(cfg),
                     tmp_path_factory.mktemp("llama_cls"))
    make_tiny_tokenizer(path)
    return path


def save_bert_tokenizer(path: Path) -> Path:
    """A WordPiece tokenizer inside BERT_SHAPE's vocabulary: specials, words, then letters."""
    import transformers

    words = ("the quick brown fox jumps over lazy dog what who hello world a cat sat on mat "
             "is it where paris city capital france").split()
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "?", ".", ",", *words, *letters,
             *(f"##{c}" for c in letters)]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    transformers.BertTokenizerFast(str(path / "vocab.txt")).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_bert_cross_encoder_dir(tmp_path_factory) -> Path:
    """BertForSequenceClassification with one label (a cross-encoder) and a tokenizer; its
    token type embeddings differ, so a wrong segment changes the score."""
    import transformers

    torch.manual_seed(4)
    # Weights large enough that the segments move the score well past the tolerance.
    cfg = transformers.BertConfig(**BERT_SHAPE, num_labels=1, initializer_range=0.3)
    model = transformers.BertForSequenceClassification(cfg)
    path = save_tiny(model, tmp_path_factory.mktemp("bert_cross"))
    return save_bert_tokenizer(path)
