"""Post-training quantization of a checkpoint directory, and writing the quantized checkpoint.

quantize_checkpoint loads the float model, calibrates when the method needs it, quantizes every
linear layer, and writes safetensors with HF names (fused q/k/v and gate/up split back) plus a
config.json whose `quantization_config` tells the loader which method reads it.
"""
from __future__ import annotations

import importlib
import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from slipstream.quantization.calibration import collect_linear_stats, load_calib_texts

logger = logging.getLogger(__name__)

METHODS = ("int8_wo", "fp8", "int4_awq", "w8a8_sq")
_SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quantize_checkpoint(model_dir: str | Path, method: str, output_dir: str | Path, *,
                        calib_data: str | Path | None = None, num_calib_samples: int = 128,
                        max_calib_len: int = 512, device: str = "cpu",
                        options: dict | None = None) -> Path:
    """Quantize `model_dir` with `method` into `output_dir`; returns output_dir.

    options: method knobs (int4_awq: group_size, awq; w8a8_sq: alpha).
    """
    from slipstream.layers.linear import LinearBase
    from slipstream.llm import LLM

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    options = dict(options or {})
    module = importlib.import_module(f"slipstream.quantization.{method}")
    dtype = "float32" if device == "cpu" else "bfloat16"
    llm = LLM(model=str(model_dir), device=device, dtype=dtype, enforce_eager=True,
              kv_cache_memory=64 << 20, max_num_seqs=8, enable_prefix_caching=False)
    model: nn.Module = llm.engine.runner.model
    if getattr(module, "NEEDS_CALIBRATION", False):
        texts = load_calib_texts(calib_data, num_calib_samples)
        stats = collect_linear_stats(llm, texts, max_calib_len)
        module.prepare_for_quantization(model, stats, **options)
    make = module.make_method
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, LinearBase):
                layer.quant_method = make(**options)
                layer.quant_method.process_after_loading(layer)
    save_checkpoint(model, model_dir, output_dir, module.checkpoint_config(**options))
    return Path(output_dir)


def checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter under its HF checkpoint name; fused layers split into their shards."""
    from slipstream.layers.linear import LinearBase

    packed: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {})
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for name, layer in model.named_modules():
        export = getattr(getattr(layer, "quant_method", None), "checkpoint_tensors", None)
        if not isinstance(layer, LinearBase) or export is None:
            continue
        tensors = dict(export(layer))
        if layer.bias is not None:
            tensors["bias"] = (layer.bias.data, 0, 1)
        parent, _, leaf = name.rpartition(".")
        subs = packed.get(leaf)
        for key, (t, out_dim, pack) in tensors.items():
            done.add(f"{name}.{key}")
            if subs is None:
                out[f"{name}.{key}"] = t
                continue
            offset = 0
            for sub, size in zip(subs, layer.output_sizes, strict=True):
                out[f"{parent}.{sub}.{key}"] = t.narrow(out_dim, offset // pack, size // pack)
                offset += size
        for pname, _ in layer.named_parameters():  # e.g. ignored input scales
            done.add(f"{name}.{pname}")
    for name, p in model.named_parameters():
        if name not in done:
            out[name] = p.data
    return out


def save_checkpoint(model: nn.Module, src_dir: str | Path, output_dir: str | Path,
                    quant_config: dict) -> None:
    """model.safetensors + config.json (with quantization_config) + the source's other files."""
    src, dst = Path(src_dir), Path(output_dir)
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    save_dtype = _SAVE_DTYPES.get(config.get("torch_dtype") or config.get("dtype"), torch.float32)
    tensors, float_names = {}, _float_names(model)
    for name, t in checkpoint_tensors(model).items():
        # Unquantized floats (embeddings, norms, lm_head) go back to the checkpoint's dtype;
        # quantized tensors and their scales keep the dtype their method chose.
        if name in float_names and t.is_floating_point():
            t = t.to(save_dtype)
        tensors[name] = t.detach().contiguous().cpu()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():  # tokenizer, generation config, README ...
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    logger.info("wrote %d tensors to %s", len(tensors), dst)


def _float_names(model: nn.Module) -> set[str]:
    """Parameters not owned by a linear layer's quant method."""
    from slipstream.layers.linear import LinearBase

    owned = {f"{n}.{p}" for n, m in model.named_modules() if isinstance(m, LinearBase)
             for p, _ in m.named_parameters() if p != "bias"}
    return {n for n, _ in model.named_parameters() if n not in owned}
