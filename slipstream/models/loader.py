"""Build a model on its device without random init, then fill it from memory-mapped safetensors.

q/k/v and gate/up checkpoint tensors land in slices of one fused parameter each (the model's
`packed_modules_mapping`). load_format="dummy" fills seeded random values instead. Optional
per-layer KV-cache scales (`...self_attn.k_scale` / `v_scale`) go to the attention layers.
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from slipstream.config import EngineConfig
from slipstream.dtypes import resolve_dtype
from slipstream.engine.startup import counting
from slipstream.kernels import get_ops
from slipstream.layers.attention import get_attention_backend
from slipstream.layers.moe import experts_of_rank
from slipstream.models.gguf import is_gguf_file, iterate_gguf_weights
from slipstream.models.llama import BuildContext
from slipstream.models.moe_config import num_experts_of
from slipstream.models.quantize_as_loaded import (
    QuantizeAsLoaded,
    decoder_layer_of,
    layer_hook_active,
)
from slipstream.models.registry import get_model_class
from slipstream.models.sizes import weight_bytes
from slipstream.parallel import state as parallel_state
from slipstream.parallel.checkpoint_slices import iterate_safetensor_slices, materialize
from slipstream.parallel.pipeline import PipelineStage, tied_head_alias
from slipstream.parallel.sharding import check_tensor_parallel
from slipstream.quantization.base import get_quant_method_factory
from slipstream.quantization.kv_cache import load_kv_scale
from slipstream.quantization.utils import deferring_load_time_weights

logger = logging.getLogger(__name__)

# "engine": a built engine's weights, already in the runtime layout (build/weights.py).
LOAD_FORMATS = ("auto", "safetensors", "dummy", "engine")


def load_model(config: EngineConfig) -> nn.Module:
    """The config's model on config.device in config.dtype, weights loaded, in eval mode."""
    if config.load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {config.load_format!r}")
    device = torch.device(config.device)
    if device.type != "cuda":
        return _load_model(config, device)
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    check_weights_fit(config, free, total)
    try:
        return _load_model(config, device)
    except torch.OutOfMemoryError as e:
        message = oom_message(config, free, total, e)
    # Raised outside the handler, unchained: the original traceback's frames would keep the
    # partly loaded model, and its device memory, alive for as long as the error is held.
    gc.collect()
    torch.cuda.empty_cache()
    raise torch.OutOfMemoryError(message)


def _load_model(config: EngineConfig, device: torch.device) -> nn.Module:
    started = time.perf_counter()
    model = build_model(config)
    if config.load_format == "engine":
        from slipstream.build.engine_dir import load_engine_weights

        load_engine_weights(model, config)
        _log_loaded(model, device, time.perf_counter() - started)
        return model.eval()
    layers = QuantizeAsLoaded(model, config.device)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed, layers)
    elif is_gguf_file(config.model_path):  # tensors come in layer order already
        load_weights(model, iterate_gguf_weights(config.model_path, checkpoint_name_map(model)),
                     layers)
    else:
        files = safetensors_files(config.model_path)
        if layer_hook_active():  # a whole-layer calibration: one decoder layer at a time
            load_weights(model, iterate_in_layer_order(files), layers)
        else:
            shards = tqdm(files, desc="Loading checkpoint shards", unit="file",
                          disable=len(files) < 2)
            load_weights(model, _iterate_checkpoint(shards, model), layers)
    layers.finish()
    if config.quant.lm_head:
        with counting("quantize"):
            model.lm_head.quantize(config.quant.lm_head)
    _log_loaded(model, device, time.perf_counter() - started)
    return model.eval()


def weights_estimate(config: EngineConfig, method: str | None = "as loaded") -> int | None:
    """Bytes the model's weights will take on the device (quantized layers at their method's
    width; `method` overrides the configured one), or None for a config the size arithmetic
    does not cover."""
    dtype = str(config.dtype).removeprefix("torch.")
    quantized_head = config.quant.lm_head if method == "as loaded" else None
    method = config.quant.method if method == "as loaded" else method
    try:
        total = weight_bytes(config.model.hf_config, dtype, method, quantized_head)
    except (KeyError, ValueError):
        return None
    return total // parallel_state.rank_info().world_size  # a rank's share, roughly


def check_weights_fit(config: EngineConfig, free: int, total: int) -> None:
    """Fail before reading the checkpoint when the weights alone exceed the free memory (2%
    margin for the estimate), not after minutes of loading."""
    need = weights_estimate(config)
    if need is not None and 0.98 * need > free:
        raise torch.OutOfMemoryError(oom_message(config, free, total, None))


def oom_message(config: EngineConfig, free: int, total: int, error: BaseException | None) -> str:
    """What to do when the weights do not fit: their size as loaded, and quantized. error: the
    allocator's, when loading ran out of memory (None: the estimate alone exceeds free memory)."""
    gib = 2**30
    dtype, method = str(config.dtype).removeprefix("torch."), config.quant.method
    size, fp8, int4 = (weights_estimate(config), weights_estimate(config, "fp8"),
                       weights_estimate(config, "int4_awq"))
    need = f"its weights take about {size / gib:.1f} GiB as loaded ({dtype}" if size else "(" + dtype
    hint = f" (about {fp8 / gib:.1f} / {int4 / gib:.1f} GiB)" if fp8 and int4 else ""
    lead = "out of GPU memory while loading" if error is not None else "not enough GPU memory for"
    tail = ""
    if error is not None:
        tail = " (" + (str(error).splitlines()[0] if str(error) else type(error).__name__) + ")"
    return (f"{lead} {config.model_path}: {need}"
            f"{', ' + method if method else ''}) and the GPU has {total / gib:.1f} GiB, "
            f"{free / gib:.1f} GiB of it free before loading. Quantize at load "
            f"(quantization='fp8' or 'int8_wo', or 'int4_awq'{hint}: weights are quantized "
            f"one layer at a time), use a smaller model or free the GPU.{tail}")


def _log_loaded(model: nn.Module, device: torch.device, seconds: float) -> None:
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: once
    peak = ""
    if device.type == "cuda":  # with load-time quantization: the quantized model + ~1 layer
        peak = f", device peak while loading {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"
    logger.info("model loaded in %.1f s: %.2f GiB of parameters%s", seconds, nbytes / 2**30, peak)


def build_model(config: EngineConfig) -> nn.Module:
    """Construct with uninitialised (torch.empty) parameters directly on the target device;
    16-bit weights that a quant method replaces at load get no storage yet (quantize_as_loaded)."""
    cls = get_model_class(config.model.architecture)
    ops = get_ops(config.device)
    rank = parallel_state.rank_info()  # tp = pp = 1 outside a distributed worker
    check_tensor_parallel(config.model, rank.tp_size)
    stage = None
    if rank.pp_size > 1:
        stage = PipelineStage.of(config.model.num_hidden_layers, rank.pp_size, rank.pp_rank)
    ctx = BuildContext(
        config.model, resolve_dtype(config.dtype), ops,
        backend=get_attention_backend(config.device, ops),
        quant_factory=get_quant_method_factory(config.quant.method, config.model.hf_config),
        max_positions=config.scheduler.max_model_len,
        tp_size=rank.tp_size, tp_rank=rank.tp_rank, stage=stage,
        local_experts=_local_experts(config, rank.tp_size, rank.tp_rank),
    )
    with torch.device(config.device), deferring_load_time_weights():
        return cls(ctx)


def _local_experts(config: EngineConfig, tp_size: int, tp_rank: int) -> tuple[int, ...] | None:
    """Expert parallelism: the experts this rank holds (None: all of them, each split)."""
    num_experts = num_experts_of(config.model.hf_config)
    if tp_size == 1 or not num_experts or not config.parallel.enable_expert_parallel:
        return None
    return experts_of_rank(num_experts, tp_size, tp_rank)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's weight files: those of the shard index if any, else every *.safetensors."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [d / n for n in names]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"shard index {index} names missing files: {', '.join(absent)}")
        return files
    files = sorted(d.glob("*.safetensors"))
    # Mistral repos ship both HF shards and an original-format `consolidated` copy.
    files = [f for f in files if not f.name.startswith("consolidated")] or files
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {d} (load_format='dummy' builds "
                                "a model of this config with random weights)")
    return files


def iterate_safetensors(files: Iterable[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) one at a time from memory-mapped files: peak host memory is one tensor."""
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def iterate_in_layer_order(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) with the tensors outside decoder layers that come before them (the
    embedding) first, then decoder layer 0, 1, ... each whole, then the rest (final norm, head),
    read by name across the files (a progress bar over the layers): a checkpoint's own order
    may interleave layers (names sort as layers.1, layers.10, layers.2) or split one across
    shards."""
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(p), framework="pt", device="cpu"))
                   for p in files]
        where = {name: h for h in handles for name in h.keys()}
        by_layer: dict[int, list[str]] = {}
        before, after = [], []
        for name in where:
            layer = decoder_layer_of(name)
            if layer is not None:
                by_layer.setdefault(layer[1], []).append(name)
            elif name.endswith("embed_tokens.weight"):
                before.append(name)
            else:
                after.append(name)
        for name in before:
            yield name, where[name].get_tensor(name)
        for i in tqdm(sorted(by_layer), desc="Loading layers", unit="layer"):
            for name in by_layer[i]:
                yield name, where[name].get_tensor(name)
        for name in after:
            yield name, where[name].get_tensor(name)


def _iterate_checkpoint(files: Iterable[Path], model: nn.Module
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """iterate_safetensors; in a distributed worker, slices read lazily instead, so a rank
    reads only its part of each tensor and nothing of another stage's."""
    if parallel_state.rank_info().world_size == 1:
        return iterate_safetensors(files)
    ignored = getattr(model, "ignored_checkpoint_tensor", lambda name: False)
    aliases = tied_head_alias(model)
    return iterate_safetensor_slices(files, lambda name: name not in aliases and ignored(name))


def checkpoint_name_map(model: nn.Module) -> dict[str, tuple[str, int | None]]:
    """Checkpoint tensor name -> (parameter name, fused shard index or None)."""
    packed: dict[str, list[str]] = getattr(model, "packed_modules_mapping", {})
    out: dict[str, tuple[str, int | None]] = {}
    for pname, _ in model.named_parameters():  # tied parameters appear once
        module_path, _, leaf = pname.rpartition(".")
        parent, _, module_name = module_path.rpartition(".")
        if module_name in packed:
            for shard, sub in enumerate(packed[module_name]):
                out[f"{parent}.{sub}.{leaf}"] = (pname, shard)
        else:
            out[pname] = (pname, None)
    remap = getattr(model, "remap_checkpoint_names", None)  # e.g. MoE experts stored apart
    return out if remap is None else remap(out)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 layers: QuantizeAsLoaded) -> None:
    """Copy every checkpoint tensor into place; unexpected or missing tensors are errors. Each
    layer is quantized (layers) once its last tensor is in."""
    name_map = checkpoint_name_map(model)
    layers.expect((pname.rpartition(".")[0], name) for name, (pname, _) in name_map.items())
    ignored = getattr(model, "ignored_checkpoint_tensor", lambda name: False)
    aliases = tied_head_alias(model)  # pipeline parallel: a tied head on the last stage
    # A model may accept other spellings of its tensor names (GPT-2 with or without its prefix).
    rename = getattr(model, "checkpoint_name", lambda name: name)
    seen: set[str] = set()
    for name, tensor in weights:
        name = rename(name)
        name = aliases.get(name, name)
        if ignored(name):
            continue
        if name not in name_map:
            tensor = materialize(tensor)
        if name not in name_map and load_kv_scale(model, name, tensor):
            continue  # optional per-layer KV-cache scale (fp8 / int8 caches)
        if name not in name_map and _unused_by_quant_method(model, name_map, name):
            continue  # e.g. fbgemm_fp8's input_scale_ub: a bound the fp8 method does not apply
        if name not in name_map:
            raise ValueError(f"unexpected tensor {name!r} in the checkpoint: no such parameter "
                             f"in {type(model).__name__}")
        pname, shard = name_map[name]
        module_path = pname.rpartition(".")[0]
        try:
            _load_one(model.get_submodule(module_path), layers.param(pname), tensor, shard)
        except ValueError as e:
            raise ValueError(f"checkpoint tensor {name!r}: {e}") from None
        seen.add(name)
        layers.arrived(module_path, name)
    missing = sorted(set(name_map) - seen)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


def _unused_by_quant_method(model: nn.Module, name_map: dict[str, tuple[str, int | None]],
                            name: str) -> bool:
    """Whether `name` is a tensor its layer's quant method declares unused (checkpoint module
    names are mapped through the weight's entry, so q/k/v_proj find the fused qkv_proj)."""
    module_name, _, leaf = name.rpartition(".")
    weight = name_map.get(f"{module_name}.weight")
    if weight is None:
        return False
    method = getattr(model.get_submodule(weight[0].rpartition(".")[0]), "quant_method", None)
    return leaf in getattr(method, "unused_checkpoint_tensors", ())


def _load_one(module: nn.Module, param: nn.Parameter, tensor: torch.Tensor,
              shard: int | None) -> None:
    loader = getattr(module, "weight_loader", None)
    if loader is not None:
        loader(param, tensor, shard)
        return
    tensor = materialize(tensor)  # a replicated tensor (norms): read whole
    if param.shape != tensor.shape:
        raise ValueError(f"shape {tuple(tensor.shape)} does not match the parameter's "
                         f"{tuple(param.shape)}")
    param.data.copy_(tensor)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, layers: QuantizeAsLoaded,
                       std: float = 0.02) -> None:
    """Seeded small random weights (norm weights near 1), generated on the parameter's device;
    each layer is quantized (layers) once its last parameter is filled."""
    generators: dict[torch.device, torch.Generator] = {}
    names = [name for name, _ in model.named_parameters()]
    layers.expect((name.rpartition(".")[0], name) for name in names)
    for name in names:
        param = layers.param(name)
        _init_dummy(param, name, generators, seed, std)
        layers.arrived(name.rpartition(".")[0], name)


def _init_dummy(param: nn.Parameter, name: str, generators: dict[torch.device, torch.Generator],
                seed: int, std: float) -> None:
    dev = param.device
    if dev not in generators:
        generators[dev] = torch.Generator(device=dev).manual_seed(seed)
    g = generators[dev]
    fixed = getattr(param, "dummy_value", None)  # e.g. a quantized layer's shapes, g_idx
    if fixed is not None:
        param.data.copy_(fixed)
    elif param.is_floating_point() and param.element_size() >= 2:
        mean = 1.0 if name.endswith("norm.weight") else 0.0
        param.data.normal_(mean, std, generator=g)
    elif param.is_floating_point():  # 8-bit floats: draw in float32, then cast
        sample = torch.empty(param.shape, device=dev).normal_(0.0, std, generator=g)
        param.data.copy_(sample)
    else:
        param.data.copy_(torch.randint(-8, 8, param.shape, generator=g, device=dev))
