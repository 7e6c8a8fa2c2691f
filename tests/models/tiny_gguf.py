"""Tiny GGUF files for tests, written with the `gguf` package as llama.cpp's converter would:
a random tests.helpers checkpoint's tensors under GGUF names (Llama q/k rows permuted), quantized
to the type asked, and the tiny byte-level BPE tokenizer with a chat template in the metadata.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from tests.helpers import make_tiny_checkpoint
from tests.tokenizer.tiny_tokenizer import CHAT_TEMPLATE, make_tiny_tokenizer

ARCHS = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
BOS, EOS, PAD, EOT = "<s>", "</s>", "<pad>", "<|end|>"
_NORMAL, _CONTROL = 1, 3  # llama.cpp token types


def tiny_tokenizer_parts(tmp_path: Path) -> dict[str, Any]:
    """tokens (by id), merges, special ids of the tiny test tokenizer."""
    tok_dir = make_tiny_tokenizer(tmp_path / "tok", add_bos=False)
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    specials = {t["content"]: t["id"] for t in data["added_tokens"]}
    vocab.update(specials)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    types = [_CONTROL if t in specials else _NORMAL for t in tokens]
    return {"tokens": tokens, "merges": merges, "types": types, "ids": vocab}


def write_tiny_gguf(tmp_path: Path, qtype: str = "F32", arch: str = "LlamaForCausalLM",
                    name: str | None = None, eot: bool = False, **overrides: Any) -> Path:
    """A tiny random model as `<tmp_path>/<name>.gguf`: 2-D weights in `qtype` (F32, F16, BF16,
    Q8_0, Q4_0, Q4_1, ...), norms in F32. overrides: tests.helpers config fields
    (tie_word_embeddings=True: no output.weight; rope_scaling of rope_type llama3: the
    rope_freqs tensor llama.cpp's converter writes for it). eot: also name <|end|> end-of-turn."""
    import gguf

    tok = tiny_tokenizer_parts(tmp_path)
    ids = tok["ids"]
    overrides = {"vocab_size": len(tok["tokens"]), "bos_token_id": ids[BOS],
                 "eos_token_id": ids[EOS], "pad_token_id": ids[PAD], **overrides}
    ckpt = make_tiny_checkpoint(tmp_path / "hf", arch, **overrides)
    cfg = json.loads((ckpt / "config.json").read_text())
    path = tmp_path / f"{name or f'tiny-{qtype}'}.gguf"
    writer = gguf.GGUFWriter(str(path), ARCHS[arch])
    _write_config(writer, cfg)
    _write_tokenizer(writer, tok, eot)
    _write_tensors(writer, ckpt, cfg, ARCHS[arch], gguf.GGMLQuantizationType[qtype])
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(cfg, rope))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_config(w, cfg: dict[str, Any]) -> None:
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_dimension_count(cfg["head_dim"])
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])


def _write_tokenizer(w, tok: dict[str, Any], eot: bool) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(tok["ids"][BOS])
    w.add_eos_token_id(tok["ids"][EOS])
    w.add_pad_token_id(tok["ids"][PAD])
    if eot:
        w.add_eot_token_id(tok["ids"][EOT])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def _write_tensors(w, ckpt: Path, cfg: dict[str, Any], arch: str, qtype) -> None:
    import gguf
    from safetensors.torch import load_file

    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), cfg["num_hidden_layers"])
    for hf_name, tensor in load_file(str(ckpt / "model.safetensors")).items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = _llama_cpp_order(tensor.float(), name, cfg, arch).numpy()
        if data.ndim == 1:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def llama_cpp_rope_factors(cfg: dict[str, Any], rope: dict[str, Any]):
    """convert_hf_to_gguf.py's rope_freqs for Llama 3 RoPE scaling: per rotary frequency, the
    divisor of its inverse frequency (float32)."""
    import numpy as np

    dim, theta = cfg["head_dim"], float(cfg.get("rope_theta") or rope["rope_theta"])
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _llama_cpp_order(w: torch.Tensor, name: str, cfg: dict[str, Any], arch: str) -> torch.Tensor:
    """convert_hf_to_gguf.py's permute of Llama q/k rows (its RoPE pairs adjacent rows)."""
    if arch != "llama" or not name.endswith(("attn_q.weight", "attn_k.weight")):
        return w
    heads = cfg["num_attention_heads"] if "attn_q" in name else cfg["num_key_value_heads"]
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .transpose(1, 2).reshape(w.shape))
