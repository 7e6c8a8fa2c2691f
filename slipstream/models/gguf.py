"""GGUF checkpoints (llama.cpp's single-file format), read with the `gguf` package: the file's
metadata as a Hugging Face config dict, and its tensors as (HF name, torch tensor) pairs in layer
order, quantized ones dequantized and Llama's q/k rows put back into HF's rotary order.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from slipstream.config import ModelConfig

logger = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
# GGUF architecture -> (HF architecture, HF model_type). llama.cpp also writes Mistral and
# other Llama-shaped models as "llama".
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# llama.cpp's convert_hf_to_gguf permutes these rows (for its interleaved RoPE) in Llama files.
_PERMUTED_ARCHS = ("llama",)
# A parameter of this name takes its module's GGUF blocks as stored (quantization/gguf_int4.py).
RAW_SUFFIX = ".gguf_blocks"
# Llama 3.x long-context RoPE: llama.cpp's converter stores, per rotary frequency, the divisor of
# its inverse frequency (1 for short wavelengths, the scaling factor for long ones, a ramp
# between). It becomes the config's rope scaling (layers/rotary.py "freq_factors"), not a weight.
# transformers' GGUF loader ignores it.
ROPE_FREQS = "rope_freqs.weight"
_IGNORED_TENSORS = (ROPE_FREQS,)


def is_gguf_file(path: str | Path | None) -> bool:
    return path is not None and str(path).lower().endswith(GGUF_SUFFIX) and Path(path).is_file()


def resolve_model_path(path: str | Path) -> str:
    """The checkpoint `path` names: a Hugging Face directory, a .gguf file, or the one .gguf file
    of a directory without a config.json."""
    p = Path(path)
    if p.is_file():
        if p.name.lower().endswith(GGUF_SUFFIX):
            return str(p)
        raise ValueError(f"model {p} is a file but not a .gguf file: give a Hugging Face "
                         "checkpoint directory or a GGUF file")
    if not p.is_dir():
        raise FileNotFoundError(f"model not found: {p} (give a Hugging Face checkpoint "
                                "directory or a .gguf file)")
    if (p / "config.json").is_file():
        return str(p)
    found = sorted(f for f in p.iterdir() if f.name.lower().endswith(GGUF_SUFFIX) and f.is_file())
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise ValueError(f"{p} holds {len(found)} GGUF files ({names}): pass the one to load "
                         "as the model path")
    return str(found[0]) if found else str(p)


def load_model_config(path: str | Path) -> ModelConfig:
    """ModelConfig of a checkpoint as resolve_model_path returns it (directory or .gguf)."""
    if is_gguf_file(path):
        return ModelConfig.from_hf_dict(gguf_hf_config(path))
    return ModelConfig.from_dir(path)


def _fast_reader_class():
    from gguf import GGUFReader

    class FastGGUFReader(GGUFReader):
        """GGUFReader over a plain ndarray view of its memory map: the same bytes, without
        np.memmap's bookkeeping on every slice, which makes parsing a vocabulary of 50k tokens
        about 3x slower."""

        @property
        def data(self) -> np.ndarray:
            return self._view

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._mapped = mapped  # keeps the mapping open
            self._view = mapped.view(np.ndarray)

    return FastGGUFReader


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int, size: int):
    try:
        return _fast_reader_class()(path)
    except ValueError as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


def open_gguf(path: str | Path):
    """The file's parsed header (a gguf.GGUFReader), parsed once per process while unchanged:
    the config, the tokenizer's EOS ids and the weights all read it."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file not found: {p}")
    st = p.stat()
    return _open(str(p.resolve()), st.st_mtime_ns, st.st_size)


def metadata(reader) -> dict[str, Any]:
    """The file's key/value metadata, without the tokenizer's large arrays (tokens, merges)."""
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and len(field.data) > 1:
            continue
        out[key] = field.contents()
    return out


def architecture(meta: dict[str, Any], path: str | Path) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    if meta.get(f"{arch}.expert_count"):
        raise ValueError(f"{path} is a mixture-of-experts {arch!r} model: not supported")
    if meta.get("split.count", 1) > 1:
        raise ValueError(f"{path} is one part of a split GGUF model: merge the parts into one "
                         "file first (llama.cpp's `llama-gguf-split --merge`)")
    return arch


def gguf_hf_config(path: str | Path) -> dict[str, Any]:
    """The Hugging Face config.json equivalent of a GGUF file's metadata."""
    reader = open_gguf(path)
    meta = metadata(reader)
    arch = architecture(meta, path)
    hf_arch, model_type = ARCHITECTURES[arch]
    heads = meta[f"{arch}.attention.head_count"]
    hidden = meta[f"{arch}.embedding_length"]
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": meta[f"{arch}.feed_forward_length"],
        "num_hidden_layers": meta[f"{arch}.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": (meta.get(f"{arch}.attention.key_length")
                     or meta.get(f"{arch}.rope.dimension_count") or hidden // heads),
        "max_position_embeddings": meta.get(f"{arch}.context_length", 2048),
        "rms_norm_eps": meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "vocab_size": meta.get(f"{arch}.vocab_size") or _vocab_size(reader),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "hidden_act": "silu",
    }
    scaling = _rope_scaling(meta, arch, path, _rope_freq_factors(reader))
    if scaling:
        cfg["rope_scaling"] = scaling
    cfg.update(special_token_ids(meta))
    # What quantization/gguf_int4.py needs to pick each layer's layout (not an HF field).
    cfg["gguf"] = {"architecture": arch, "block_count": cfg["num_hidden_layers"],
                   "tensor_types": {t.name: t.tensor_type.name for t in reader.tensors}}
    return cfg


def _vocab_size(reader) -> int:
    field = reader.fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise ValueError("GGUF file has neither a vocab_size nor a token list")
    return len(field.data)


def _rope_freq_factors(reader) -> list[float] | None:
    """The rope_freqs tensor's values (one divisor per rotary frequency), or None."""
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    return None if tensor is None else [float(f) for f in to_torch(tensor).flatten().tolist()]


def _rope_scaling(meta: dict[str, Any], arch: str, path: str | Path,
                  freq_factors: list[float] | None = None) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if freq_factors is not None:
        if kind != "none":
            raise ValueError(f"{path}: a {ROPE_FREQS} tensor together with RoPE scaling "
                             f"{kind!r} is not supported")
        return {"rope_type": "freq_factors", "freq_factors": freq_factors}
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise ValueError(f"{path}: RoPE scaling {kind!r} is not supported for GGUF files")


def special_token_ids(meta: dict[str, Any]) -> dict[str, Any]:
    """bos / eos / pad ids; eos also lists llama.cpp's end-of-turn ids, where generation ends
    too."""
    get = functools.partial(_token_id, meta)
    out: dict[str, Any] = {}
    if get("bos") is not None:
        out["bos_token_id"] = get("bos")
    eos = [i for i in (get("eos"), get("eot"), get("eom")) if i is not None]
    if eos:
        eos = list(dict.fromkeys(eos))
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if get("padding") is not None:
        out["pad_token_id"] = get("padding")
    return out


def _token_id(meta: dict[str, Any], name: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{name}_token_id")
    return None if value is None else int(value)


def eos_token_ids(path: str | Path) -> tuple[int, ...]:
    eos = special_token_ids(metadata(open_gguf(path))).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def gguf_name_map(reader, hf_names: Iterable[str]) -> dict[str, str]:
    """GGUF tensor name -> HF checkpoint name, for the HF names a model expects (the `gguf`
    package's table of llama.cpp's names). `<module>.gguf_blocks` names the module's weight
    kept in its GGUF blocks (quantization/gguf_int4.py)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_name = reader.fields["general.architecture"].contents()
    arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch_name)
    blocks = reader.fields[f"{arch_name}.block_count"].contents()
    table = get_tensor_name_map(arch, blocks)
    out = {}
    for hf in hf_names:
        if hf.endswith(RAW_SUFFIX):
            name = table.get_name(hf.removesuffix(RAW_SUFFIX))
            name = None if name is None else name + ".weight"
        else:
            name = table.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is not None:
            out[name] = hf
    return out


def iterate_gguf_weights(path: str | Path, hf_names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor in the file, embedding first, then each decoder layer
    whole, then the rest. F32/F16/BF16 come as stored, other types dequantized to float32."""
    reader = open_gguf(path)
    names = gguf_name_map(reader, hf_names)
    meta = metadata(reader)
    arch = architecture(meta, path)
    for t in sorted(reader.tensors, key=_layer_order):
        if t.name in _IGNORED_TENSORS:  # in the config (gguf_hf_config), not a parameter
            continue
        if t.name not in names:
            raise ValueError(f"unexpected tensor {t.name!r} in {path}: no matching parameter")
        raw = names[t.name].endswith(RAW_SUFFIX)
        tensor = torch.from_numpy(np.array(t.data)) if raw else to_torch(t)
        yield names[t.name], _unpermuted(tensor, t.name, meta, arch)


def _layer_order(tensor) -> tuple[int, int]:
    parts = tensor.name.split(".")
    if parts[0] == "blk":
        return 1, int(parts[1])
    return (0, 0) if parts[0] == "token_embd" else (2, 0)


def to_torch(tensor) -> torch.Tensor:
    """A reader tensor as a torch tensor of its logical shape (rows = ne[1], ...)."""
    from gguf import GGMLQuantizationType, dequantize

    kind = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if kind == GGMLQuantizationType.BF16:  # exact: reinterpret the stored bits
        bits = np.array(tensor.data).view(np.int16)  # a copy: the mapping is read-only
        return torch.from_numpy(bits).view(torch.bfloat16).reshape(shape)
    if kind.name in ("F32", "F16"):
        return torch.from_numpy(np.array(tensor.data)).reshape(shape)
    return torch.from_numpy(dequantize(tensor.data, kind)).reshape(shape)


def _unpermuted(w: torch.Tensor, name: str, meta: dict[str, Any], arch: str) -> torch.Tensor:
    if arch not in _PERMUTED_ARCHS or not name.endswith((".attn_q.weight", ".attn_k.weight",
                                                         ".attn_q.bias", ".attn_k.bias")):
        return w
    heads = meta[f"{arch}.attention.head_count"]
    if ".attn_k." in name:
        heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    return unpermute_rows(w, heads)


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permute: GGUF interleaves each head's rotary pairs (rows 2i, 2i+1
    are pair i), HF keeps every pair's first row in the head's first half, its second in the
    second half."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
