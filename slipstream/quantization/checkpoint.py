"""Post-training quantization of a checkpoint directory, and writing the quantized checkpoint.

A GGUF model (a .gguf file, or a directory holding one) is first written out as a float HF
checkpoint in a temporary directory beside the output (models/gguf_convert.py), which is then
quantized as any other; the output holds its tokenizer files and chat template.

quantize_checkpoint loads the float model, calibrates when the method needs it, quantizes every
linear layer, and writes safetensors with HF names (fused q/k/v and gate/up split back) plus a
config.json whose `quantization_config` tells the loader which method reads it. With a KV-cache
dtype it also calibrates per-layer k_scale / v_scale and records `kv_cache_dtype` in config.json;
method "none" keeps the weights as they are (copied) and adds only the KV scales.
"""
from __future__ import annotations

import importlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm.auto import tqdm

from slipstream.dtypes import resolve_dtype
from slipstream.layers.linear import LinearBase
from slipstream.models.gguf import is_gguf_file, resolve_model_path
from slipstream.models.norm_fold import kept_norms
from slipstream.models.quantize_as_loaded import before_each_layer
from slipstream.quantization.awq import LayerByLayerAwq
from slipstream.quantization.base import METHOD_NAMES, UnquantizedLinearMethod
from slipstream.quantization.calibration import (
    calibration_prompts,
    collect_linear_stats,
    load_calib_texts,
)
from slipstream.quantization.fp8 import MIN_CAPABILITY
from slipstream.quantization.fp8_calibration import checkpoint_module_names
from slipstream.quantization.gptq import GptqOptions
from slipstream.quantization.int4_awq import DEFAULT_GROUP, calibration_choice
from slipstream.quantization.kv_cache import (
    KV_CACHE_DTYPES,
    QUANT_KV_NAMES,
    attention_layers,
    calibrate_kv_amax,
    kv_scale_tensors,
    set_kv_scales,
)
from slipstream.quantization.lm_head import head_format
from slipstream.quantization.w8a8_sq import LayerByLayerSmoothQuant
from slipstream.tokenizer.tokenizer import maybe_load_tokenizer

logger = logging.getLogger(__name__)

METHODS = (*METHOD_NAMES, "none")
KV_SCALES_FILE = "kv_cache_scales.safetensors"  # method "none": scales beside the copied weights
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 << 30  # as transformers shards by default
_SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def quantize_checkpoint(model_dir: str | Path, method: str, output_dir: str | Path, *,
                        calib_data: str | Path | None = None, num_calib_samples: int = 128,
                        max_calib_len: int = 512, device: str = "cpu",
                        options: dict | None = None, kv_cache_dtype: str | None = None,
                        quantize_lm_head: bool | str = False,
                        max_shard_bytes: int = MAX_SHARD_BYTES, stream_layers: bool = True) -> Path:
    """Quantize `model_dir` (a checkpoint directory, a .gguf file or a directory holding one)
    with `method` into `output_dir`; returns output_dir.

    options: method knobs (int4_awq: group_size, awq, gptq; w8a8_sq: alpha; fp8: keep_float, the
    number of projections measured on the calibration set to keep in 16 bits,
    fp8_calibration.py). kv_cache_dtype "fp8" /
    "int8": calibrate per-layer KV scales (on the quantized model, so they match what it
    computes) and make that the checkpoint's default KV dtype. quantize_lm_head: config.json
    asks the engine to quantize the LM head at load (True: the method's own format, or a format
    named, quantization/lm_head.py; the head is stored float, as read).
    stream_layers: calibrate each decoder layer as it is loaded and quantize it right after
    (streamed_calibration: int4_awq at the default group size, w8a8_sq), so the float model never
    has to fit; False loads the whole float model first (int4_awq: the same tensors; w8a8_sq:
    the same statistics up to float rounding; tested).
    """
    if is_gguf_file(resolve_model_path(model_dir)):
        return _quantize_gguf(resolve_model_path(model_dir), method, output_dir, calib_data=calib_data,
                              num_calib_samples=num_calib_samples, max_calib_len=max_calib_len,
                              device=device, options=options, kv_cache_dtype=kv_cache_dtype,
                              quantize_lm_head=quantize_lm_head, max_shard_bytes=max_shard_bytes,
                              stream_layers=stream_layers)
    # Lazy: the engine loads when a checkpoint is quantized, not for `slipstream --help`.
    from slipstream.llm import LLM

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if kv_cache_dtype not in (None, "auto", *QUANT_KV_NAMES):
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of auto, "
                         f"{', '.join(QUANT_KV_NAMES)}")
    kv_cache_dtype = None if kv_cache_dtype == "auto" else kv_cache_dtype
    if method == "none" and kv_cache_dtype is None:
        raise ValueError("method 'none' quantizes only the KV cache: pass kv_cache_dtype")
    if (options or {}).get("keep_float") and method != "fp8":
        raise ValueError("keep_float (projections kept in 16 bits) is an fp8 option")
    if quantize_lm_head and method == "none":
        raise ValueError("quantize_lm_head needs a weight quantization method, not 'none'")
    head_format(quantize_lm_head, method)  # an unknown or unsupported format fails here, not at load
    if Path(output_dir).resolve() == Path(model_dir).resolve():
        raise ValueError(f"the output directory must differ from the source checkpoint "
                         f"({model_dir}): its weight files would be replaced")
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    dtype = "float32" if device == "cpu" else "bfloat16"
    module = importlib.import_module(f"slipstream.quantization.{method}") if method != "none" else None
    at_load = quantizes_at_load(method, module, options, device)
    streamed = stream_layers and streams_calibration(method, options)
    texts = load_calib_texts(calib_data, num_calib_samples) if streamed else None
    # A float KV cache while calibrating: every layer must see exact K/V.
    engine_args = dict(model=str(model_dir), device=device, dtype=dtype, enforce_eager=True,
                       kv_cache_memory=64 << 20, max_num_seqs=8, enable_prefix_caching=False,
                       kv_cache_dtype=dtype,
                       quantization=method if at_load or streamed else None)
    with kept_norms():  # the written checkpoint keeps the source's norms
        if streamed:
            llm = streamed_calibration(model_dir, method, texts, max_calib_len, engine_args,
                                       options)
        else:
            llm = LLM(**engine_args)
    model: nn.Module = llm.engine.runner.model
    kept_float: list[str] = []
    if module is not None and not at_load and not streamed:
        if getattr(module, "NEEDS_CALIBRATION", False):
            texts = load_calib_texts(calib_data, num_calib_samples)
            # A method may gather its own calibration (AWQ reruns the prompts layer by layer).
            collect = getattr(module, "collect_calibration", collect_linear_stats)
            stats = collect(llm, texts, max_calib_len)
            module.prepare_for_quantization(model, stats, **dict(options or {}))
        if (options or {}).get("keep_float"):  # fp8: the projections that lose most stay float
            texts = texts or load_calib_texts(calib_data, num_calib_samples)
            kept_float = module.float_layers(llm, texts, max_calib_len, options["keep_float"])
        _quantize_linears(model, module, dict(options or {}), skip=set(kept_float))
    kv_tensors: dict[str, torch.Tensor] = {}
    if kv_cache_dtype is not None:
        texts = texts or load_calib_texts(calib_data, num_calib_samples)
        kv_tensors = calibrate_kv_scales(llm, texts, max_calib_len, kv_cache_dtype)
    if method == "none":
        save_kv_scales_only(model_dir, output_dir, kv_tensors, kv_cache_dtype)
    else:
        quant_config = module.checkpoint_config(**(options or {}))
        if kept_float:
            packed = getattr(model, "packed_modules_mapping", {})
            quant_config["ignored_layers"] = checkpoint_module_names(kept_float, packed)
        save_checkpoint(model, model_dir, output_dir, quant_config,
                        kv_tensors=kv_tensors, kv_cache_dtype=kv_cache_dtype,
                        quantize_lm_head=quantize_lm_head, max_shard_bytes=max_shard_bytes)
    return Path(output_dir)


def _quantize_gguf(gguf_path: str, method: str, output_dir: str | Path, **kwargs) -> Path:
    """quantize_checkpoint of a GGUF file: its float HF checkpoint, written to a temporary
    directory next to the output, quantized, then removed."""
    from slipstream.models.gguf_convert import write_hf_checkpoint

    if method not in METHODS:  # before minutes of conversion
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    out = Path(output_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-gguf-", dir=out.parent) as tmp:
        logger.info("writing %s as a float checkpoint in %s", gguf_path, tmp)
        src = write_hf_checkpoint(gguf_path, tmp, kwargs["max_shard_bytes"])
        return quantize_checkpoint(src, method, out, **kwargs)


def streamed_calibration(model_dir: str | Path, method: str, texts: list[str],
                         max_calib_len: int, engine_args: dict, options: dict | None):
    """An LLM of `model_dir` whose `method` layers were calibrated while loading: the loader
    feeds the checkpoint one decoder layer at a time, each layer gets its AWQ search or
    SmoothQuant scales from the calibration prompts' float residual stream (kept between
    layers) and is quantized before the next one is read. The device holds the quantized layers,
    one float layer and the calibration activations, never the float model."""
    from slipstream.llm import LLM  # lazy, as in quantize_checkpoint

    vocab = source_config(model_dir)["vocab_size"]
    prompts = calibration_prompts(maybe_load_tokenizer(str(model_dir)), texts, max_calib_len,
                                  vocab)
    if method == "int4_awq":
        awq, gptq = calibration_choice((options or {}).get("awq"), (options or {}).get("gptq"))
        hook = LayerByLayerAwq(prompts, DEFAULT_GROUP, progress=True, awq=awq,
                               gptq=GptqOptions() if gptq else None)
    else:
        hook = LayerByLayerSmoothQuant(prompts, **dict(options or {}))
    with before_each_layer(hook):
        llm = LLM(**engine_args)
    layers = len(llm.engine.runner.model.model.layers)
    if hook.next_layer != layers:
        raise RuntimeError(f"{method}: calibrated {hook.next_layer} of {layers} decoder layers")
    return llm


def streams_calibration(method: str, options: dict | None) -> bool:
    """Whether `slipstream quantize` calibrates `method` layer by layer while loading: int4_awq
    at the default group size with AWQ or GPTQ on, w8a8_sq (any alpha)."""
    if method != "int4_awq":
        return method == "w8a8_sq"
    options = dict(options or {})
    return _default_group(options) and any(calibration_choice(options.get("awq"),
                                                              options.get("gptq")))


def _default_group(options: dict) -> bool:
    """Whether int4_awq `options` hold nothing but AWQ / GPTQ switches and the default group
    size (the one the engine rounds to at load)."""
    return (set(options) <= {"group_size", "awq", "gptq"}
            and options.get("group_size", DEFAULT_GROUP) == DEFAULT_GROUP)


def quantizes_at_load(method: str, module, options: dict | None, device: str) -> bool:
    """Whether the engine can quantize `method` while loading (one layer at a time: the 16-bit
    model never has to fit the device): methods without calibration or options, int4_awq
    without AWQ or GPTQ (round-to-nearest at group 128, what it does at load), on a device that
    runs them (an fp8 checkpoint can still be written on a GPU without FP8 units)."""
    if method == "int4_awq" and options and options.get("awq") is False:
        return not calibration_choice(False, options.get("gptq"))[1] and _default_group(options)
    if module is None or getattr(module, "NEEDS_CALIBRATION", False) or options:
        return False
    if method == "fp8" and torch.device(device).type == "cuda":
        return torch.cuda.get_device_capability(torch.device(device)) >= MIN_CAPABILITY
    return True


def _quantize_linears(model: nn.Module, module, options: dict, skip: set[str] = frozenset()
                      ) -> None:
    """Every linear layer but those named in `skip` (module paths: they stay float)."""
    with torch.no_grad():
        for name, layer in model.named_modules():
            if isinstance(layer, LinearBase) and name not in skip:
                layer.quant_method = module.make_method(**options)
                layer.quant_method.process_after_loading(layer)


def calibrate_kv_scales(llm, texts: list[str], max_len: int,
                        kv_cache_dtype: str) -> dict[str, torch.Tensor]:
    """Per-layer k_scale / v_scale for a `kv_cache_dtype` cache from `texts` run through llm's
    model (calibrate_kv_amax, as at engine start); checkpoint name -> float32 scalar."""
    cfg = llm.engine_config
    model: nn.Module = llm.engine.runner.model
    max_len = min(max_len, cfg.scheduler.max_model_len)
    prompts = calibration_prompts(llm.tokenizer, texts, max_len, cfg.model.vocab_size)
    amax = calibrate_kv_amax(model, prompts, dtype=resolve_dtype(cfg.dtype), device=cfg.device,
                             block_size=cfg.cache.block_size)
    set_kv_scales([a for _, a in attention_layers(model)], amax, KV_CACHE_DTYPES[kv_cache_dtype])
    logger.info("calibrated %s KV-cache scales on %d prompts (%d tokens)", kv_cache_dtype,
                len(prompts), sum(map(len, prompts)))
    return kv_scale_tensors(model)


def checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter under its HF checkpoint name; fused layers split into their shards."""
    packed: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {})
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for name, layer in model.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        tensors = _linear_tensors(layer)
        if tensors is None:
            continue
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
        if name not in done:  # minus what loading added (layers/norm.py: Gemma's 1 + w)
            offset = getattr(p, "checkpoint_offset", 0.0)
            out[name] = p.data - offset if offset else p.data
    return out


def _linear_tensors(layer: nn.Module) -> dict[str, tuple[torch.Tensor, int, int]] | None:
    """A linear layer's tensors in checkpoint layout (leaf -> tensor, output dim, pack factor);
    fused shards are split by the caller."""
    export = getattr(getattr(layer, "quant_method", None), "checkpoint_tensors", None)
    return dict(export(layer)) if export is not None else None


def source_config(model_dir: str | Path) -> dict:
    """The source checkpoint's config.json."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def save_checkpoint(model: nn.Module, src_dir: str | Path, output_dir: str | Path,
                    quant_config: dict, *, kv_tensors: dict[str, torch.Tensor] | None = None,
                    kv_cache_dtype: str | None = None, quantize_lm_head: bool | str = False,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """model.safetensors (or shards of at most max_shard_bytes with their index) + config.json
    (with quantization_config) + the source's other files.

    kv_tensors (per-layer KV scales, float32) go into model.safetensors as they are and
    kv_cache_dtype into config.json; without them a stale `kv_cache_dtype` is dropped. So is
    `quantize_lm_head` (true: the engine quantizes the float head it reads) without the flag.
    """
    src, dst = Path(src_dir), Path(output_dir)
    dst.mkdir(parents=True, exist_ok=True)
    config = source_config(src)
    save_dtype = _SAVE_DTYPES.get(config.get("torch_dtype") or config.get("dtype"), torch.float32)
    float_names = _float_names(model)

    def on_host(name: str, t: torch.Tensor) -> torch.Tensor:
        # Unquantized floats (embeddings, norms, lm_head) go back to the checkpoint's dtype;
        # quantized tensors and their scales keep the dtype their method chose.
        if name in float_names and t.is_floating_point():
            t = t.to(save_dtype)
        return t.detach().contiguous().cpu()

    tensors = {**checkpoint_tensors(model), **(kv_tensors or {})}
    write_safetensors(tensors, dst, on_host, max_shard_bytes)
    config["quantization_config"] = quant_config
    config.pop("quantize_lm_head", None)
    if quantize_lm_head:
        config["quantize_lm_head"] = quantize_lm_head  # true, or the format named
    _write_config(dst, config, kv_cache_dtype)
    for f in src.iterdir():  # tokenizer, generation config, README ...
        if f.is_file() and f.suffix != ".safetensors" and f.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(f, dst / f.name)
    logger.info("wrote %d tensors to %s", len(tensors), dst)


def write_safetensors(tensors: dict[str, torch.Tensor], dst: Path,
                      on_host: Callable[[str, torch.Tensor], torch.Tensor],
                      max_shard_bytes: int) -> None:
    """`tensors` (still on their device) as model.safetensors, or, past max_shard_bytes, as
    model-0000i-of-0000n.safetensors shards plus model.safetensors.index.json (the layout the
    loader and transformers read). One shard at a time is on the host (on_host converts each
    tensor), so a 70 GB checkpoint needs ~max_shard_bytes of host memory, not 70 GB. Earlier
    weight files of this layout in dst are removed first: a stale shard would load too."""
    for old in [*dst.glob("model*.safetensors"), dst / INDEX_FILE]:
        if old.is_file():
            old.unlink()
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)])
    weight_map, total = {}, 0
    for names, fname in zip(tqdm(shards, desc="Writing checkpoint shards", unit="file",
                                 disable=len(shards) < 2), files, strict=True):
        part = {name: on_host(name, tensors[name]) for name in names}
        save_file(part, str(dst / fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in part.values())
        weight_map.update(dict.fromkeys(names, fname))
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def save_kv_scales_only(src_dir: str | Path, output_dir: str | Path,
                        kv_tensors: dict[str, torch.Tensor], kv_cache_dtype: str) -> None:
    """The source checkpoint copied unchanged, plus KV_SCALES_FILE (listed in the shard index
    when there is one) and kv_cache_dtype in config.json."""
    src, dst = Path(src_dir), Path(output_dir)
    clash = _names_in(src, set(kv_tensors))
    if clash:
        raise ValueError(f"{src} already holds KV-cache scales ({sorted(clash)[0]} ...); "
                         "quantize its weights too, or remove them first")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, dst / f.name)
    save_file({k: v.contiguous() for k, v in kv_tensors.items()}, str(dst / KV_SCALES_FILE),
              metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data.setdefault("weight_map", {}).update({k: KV_SCALES_FILE for k in kv_tensors})
        index.write_text(json.dumps(data, indent=2) + "\n")
    _write_config(dst, json.loads((src / "config.json").read_text()), kv_cache_dtype)
    logger.info("wrote %d KV-cache scales to %s", len(kv_tensors), dst)


def _names_in(src: Path, names: set[str]) -> set[str]:
    """Which of `names` the source's weight files hold (other than our own scales file)."""
    found: set[str] = set()
    for f in src.glob("*.safetensors"):
        if f.name != KV_SCALES_FILE:
            with safe_open(str(f), framework="pt") as st:
                found |= names & set(st.keys())
    return found


def _write_config(dst: Path, config: dict, kv_cache_dtype: str | None) -> None:
    if kv_cache_dtype is None:
        config.pop("kv_cache_dtype", None)
    else:
        config["kv_cache_dtype"] = kv_cache_dtype
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _float_names(model: nn.Module) -> set[str]:
    """Parameters not owned by a linear layer's quant method, and unquantized linear layers'
    weights under their checkpoint names (fused shards split)."""
    owned = {f"{n}.{p}" for n, m in model.named_modules() if isinstance(m, LinearBase)
             for p, _ in m.named_parameters() if p != "bias"}
    packed: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {})
    kept = [n for n, m in model.named_modules() if isinstance(m, LinearBase)
            and isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod)]
    kept_weights = {f"{name}.weight" for name in checkpoint_module_names(kept, packed)}
    return {n for n, _ in model.named_parameters() if n not in owned} | kept_weights
