"""KV-cache quantization: fp8 (e4m3) or int8 K/V storage with one float32 scale per layer for K
and one for V (real value = stored * scale), held by each Attention layer.

Where the scales come from: the checkpoint (`model.layers.N.self_attn.k_scale` / `v_scale`, the
names vLLM and llm-compressor write); else fp8 uses 1.0 and int8 calibrates once at engine start
with calibrate_kv_amax, the same function `slipstream quantize --kv-cache-dtype` runs.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from slipstream.dtypes import resolve_dtype
from slipstream.engine.request import Request
from slipstream.kernels.reference import KV_QMAX
from slipstream.layers.attention import Attention
from slipstream.quantization import modelopt
from slipstream.quantization.calibration import calibration_prompts, load_calib_texts
from slipstream.runner.input_batch import prepare_inputs
from slipstream.sampling_params import SamplingParams
from slipstream.scheduler.output import ScheduledSeq
from slipstream.tokenizer.tokenizer import maybe_load_tokenizer

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                   "float16": torch.float16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}
QUANT_KV_NAMES = ("fp8", "int8")  # the 1-byte caches that need scales
_ALIASES = {"fp8_e4m3": "fp8"}
# The calibrated amax maps to qmax / headroom: values up to 20% past the largest seen still fit.
KV_SCALE_HEADROOM = 1.2
STARTUP_CALIB_SAMPLES = 8  # stdlib excerpts run at engine start for int8 without scales
STARTUP_CALIB_LEN = 512  # tokens per calibration prompt at most
MIN_FP8_CAPABILITY = (8, 9)


# ---- names and checks ----------------------------------------------------------------------
def kv_dtype_name(dtype: torch.dtype) -> str:
    return next(n for n, d in KV_CACHE_DTYPES.items() if d == dtype)


def checkpoint_kv_cache_dtype(hf_config: dict | None) -> str | None:
    """The KV dtype a checkpoint asks for: slipstream's top-level `kv_cache_dtype`, or
    llm-compressor's quantization_config.kv_cache_scheme (8-bit float: fp8, int: int8), or
    ModelOpt's kv_cache_quant_algo."""
    cfg = hf_config or {}
    name = cfg.get("kv_cache_dtype")
    if name:
        return _ALIASES.get(str(name), str(name))
    qc = cfg.get("quantization_config") or {}
    if modelopt.is_modelopt(qc):
        return modelopt.kv_cache_dtype(qc)
    scheme = qc.get("kv_cache_scheme") or {}
    if scheme.get("num_bits") == 8:
        return "int8" if scheme.get("type") == "int" else "fp8"
    return None


def resolve_kv_cache_dtype(name: str, model_dtype: str, hf_config: dict | None = None,
                           ) -> torch.dtype:
    """The cache's element type for kv_cache_dtype `name`. "auto": what the checkpoint's config
    asks for (a `slipstream quantize --kv-cache-dtype` output), else the model dtype."""
    if name == "auto":
        name = checkpoint_kv_cache_dtype(hf_config) or model_dtype
    name = _ALIASES.get(name, name)
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unsupported kv_cache_dtype {name!r}; supported: auto, "
                         f"{', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def check_kv_cache_device(dtype: torch.dtype, device: torch.device | str) -> None:
    """fp8 KV needs compute capability 8.9+ (Ada / Hopper) for its conversions: say so early."""
    device = torch.device(device)
    if dtype != torch.float8_e4m3fn or device.type != "cuda":
        return
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_FP8_CAPABILITY:
        raise RuntimeError(f"kv_cache_dtype='fp8' needs a GPU of compute capability >= 8.9; "
                           f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]} "
                           "(use kv_cache_dtype='int8' or 'auto')")


# ---- scales on the model, in and out of checkpoints ----------------------------------------
def attention_layers(model: nn.Module) -> list[tuple[str, Attention]]:
    """(module name, layer) of every Attention in forward order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Attention)]


def _checkpoint_prefix(module_name: str) -> str:
    """`model.layers.N.self_attn.attn` -> `model.layers.N.self_attn` (where checkpoints put it)."""
    parent, _, leaf = module_name.rpartition(".")
    return parent if leaf == "attn" else module_name


def kv_scale_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> float32 scalar of every layer's k_scale and v_scale."""
    out = {}
    for name, attn in attention_layers(model):
        prefix = _checkpoint_prefix(name)
        out[f"{prefix}.k_scale"] = attn.k_scale.detach().float().cpu().clone()
        out[f"{prefix}.v_scale"] = attn.v_scale.detach().float().cpu().clone()
    return out


# Checkpoint leaf -> the scales it sets (longest leaves first): ModelOpt's on k_proj / v_proj (or
# on a fused qkv_proj), ours / vLLM / llm-compressor, older vLLM (one for both), AutoFP8's output
# scales of k_proj / v_proj.
_SCALE_LEAVES = {"k_proj.k_scale": ("k_scale",), "v_proj.v_scale": ("v_scale",),
                 "qkv_proj.k_scale": ("k_scale",), "qkv_proj.v_scale": ("v_scale",),
                 "k_scale": ("k_scale",), "v_scale": ("v_scale",),
                 "kv_scale": ("k_scale", "v_scale"), "k_proj.output_scale": ("k_scale",),
                 "v_proj.output_scale": ("v_scale",)}


def _split_scale_name(name: str) -> tuple[str, tuple[str, ...]] | None:
    for leaf, targets in _SCALE_LEAVES.items():
        if name.endswith("." + leaf):
            return name[: -len(leaf) - 1], targets
    return None


@torch.no_grad()
def load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Copy a checkpoint KV-cache scale into its Attention layer; False if `name` is not one.

    A scalar or 1-element tensor; several values (per head) become their max, which covers
    every head's range since the kernels quantize with one scale per layer.
    """
    split = _split_scale_name(name)
    if split is None:
        return False
    prefix, targets = split
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        return False
    attn = module if isinstance(module, Attention) else getattr(module, "attn", None)
    if not isinstance(attn, Attention):
        return False
    values = tensor.detach().float().reshape(-1)
    if values.numel() == 0 or not bool(torch.isfinite(values).all()) or values.max() <= 0:
        raise ValueError(f"checkpoint KV-cache scale {name!r} must be finite and positive, "
                         f"got {values.tolist()[:8]}")
    for target in targets:
        getattr(attn, target).fill_(values.max().item())
        attn.kv_scales_from_checkpoint.add(target)
    return True


def scale_from_amax(amax: float, dtype: torch.dtype, headroom: float = KV_SCALE_HEADROOM) -> float:
    """Scale that maps amax * headroom to the format's largest value (1.0 for an all-zero layer)."""
    if not amax > 0.0:
        return 1.0
    return amax * headroom / KV_QMAX[dtype]


@torch.no_grad()
def set_kv_scales(layers: list[Attention], amax: list[tuple[float, float]], dtype: torch.dtype,
                  only_missing: bool = False) -> None:
    """Each layer's scales from its (K amax, V amax); only_missing keeps checkpoint scales."""
    for attn, (k_max, v_max) in zip(layers, amax, strict=True):
        for attr, value in (("k_scale", k_max), ("v_scale", v_max)):
            if not (only_missing and attr in attn.kv_scales_from_checkpoint):
                getattr(attn, attr).fill_(scale_from_amax(value, dtype))


# ---- calibration ---------------------------------------------------------------------------
def _batches(prompts: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    batches, cur, n = [], [], 0
    for p in prompts:
        if cur and n + len(p) > max_tokens:
            batches.append(cur)
            cur, n = [], 0
        cur.append(p)
        n += len(p)
    return batches + ([cur] if cur else [])


@torch.inference_mode()
def calibrate_kv_amax(model: nn.Module, prompts: list[list[int]], *, dtype: torch.dtype,
                      device: torch.device | str, block_size: int = 16,
                      max_batch_tokens: int = 2048) -> list[tuple[float, float]]:
    """Per attention layer, in order: (max |K| after RoPE, max |V|) over the prompts' tokens.

    Runs the model's prefill on a scratch KV cache in the float `dtype` (never the quantized
    one, so every layer sees exact inputs) and reads the amax off the cache: what it holds is
    exactly what a quantized cache would have to store.
    """
    layers = [a for _, a in attention_layers(model)]
    prompts = [p for p in prompts if p]
    if not layers or not prompts:
        raise ValueError("KV-cache calibration needs a model with attention layers and prompts")
    batches = _batches(prompts, max_batch_tokens)
    num_blocks = max(sum(-(-len(p) // block_size) for p in b) for b in batches)
    caches = [tuple(torch.zeros((num_blocks, block_size, a.num_kv_heads, a.head_dim),
                                dtype=dtype, device=device) for _ in range(2)) for a in layers]
    amax = torch.zeros((len(layers), 2), dtype=torch.float32, device=device)
    for batch in batches:
        seqs, next_block = [], 0
        for i, ids in enumerate(batch):
            nb = -(-len(ids) // block_size)
            req = Request(f"kv-calib-{i}", ids, SamplingParams(max_tokens=1))
            seqs.append(ScheduledSeq(req, ids, 0, list(range(next_block, next_block + nb)), True))
            next_block += nb
        inputs = prepare_inputs(seqs, block_size, torch.device(device))
        model(inputs.input_ids, inputs.positions, caches, inputs.meta)
        # Stale rows of an earlier batch are calibration values too; unused rows are zero.
        now = torch.stack([torch.stack([k.abs().amax(), v.abs().amax()]) for k, v in caches])
        amax = torch.maximum(amax, now.float())
    values = amax.tolist()  # one host sync for all layers
    if not all(v == v and v != float("inf") for row in values for v in row):
        raise ValueError("KV-cache calibration saw non-finite K/V values")
    return [(k, v) for k, v in values]


def startup_calibration_prompts(config) -> list[list[int]]:
    """The built-in calibration set (stdlib excerpts) as token ids for this engine's model;
    seeded random ids when weights are dummy or there is no tokenizer."""
    texts = load_calib_texts(None, STARTUP_CALIB_SAMPLES)
    max_len = min(STARTUP_CALIB_LEN, config.scheduler.max_model_len)
    tokenizer = None if config.load_format == "dummy" else maybe_load_tokenizer(config.tokenizer_path)
    return calibration_prompts(tokenizer, texts, max_len, config.model.vocab_size,
                               seed=config.seed)


def _adapt_checkpoint_scales(layers: list[Attention], hf_config: dict | None,
                             kv_dtype: torch.dtype) -> None:
    """Checkpoint scales were made for one format: its declared kv_cache_dtype, else fp8 (what
    vLLM / llm-compressor write). int8 scales serve fp8 after rescaling (same covered range,
    e4m3 precision is relative); fp8 scales would clip int8, so int8 drops them and calibrates."""
    made_for = KV_CACHE_DTYPES.get(checkpoint_kv_cache_dtype(hf_config) or "fp8")
    if made_for == kv_dtype or not any(a.kv_scales_from_checkpoint for a in layers):
        return
    if kv_dtype == torch.float8_e4m3fn and made_for == torch.int8:
        with torch.no_grad():
            for a in layers:
                for attr in a.kv_scales_from_checkpoint:
                    getattr(a, attr).mul_(KV_QMAX[torch.int8] / KV_QMAX[kv_dtype])
        return
    logger.info("checkpoint KV-cache scales are for %s, not %s: recalibrating", made_for,
                kv_dtype)
    for a in layers:
        a.kv_scales_from_checkpoint.clear()


def prepare_kv_scales(model: nn.Module, config, kv_dtype: torch.dtype) -> str:
    """Give every attention layer its K/V scales for a `kv_dtype` cache; returns (and logs)
    where they came from: "checkpoint", "default" (fp8: 1.0), "calibrated" (int8) or "unused".
    Layers the checkpoint covers only partly get the default / calibration for the rest.
    """
    layers = [a for _, a in attention_layers(model)]
    if kv_dtype not in KV_QMAX or not layers:
        if any(a.kv_scales_from_checkpoint for a in layers):
            logger.info("checkpoint KV-cache scales unused: the KV cache is %s", kv_dtype)
        return "unused"
    _adapt_checkpoint_scales(layers, config.model.hf_config, kv_dtype)
    if all(a.kv_scales_from_checkpoint == {"k_scale", "v_scale"} for a in layers):
        source = "checkpoint"
    elif kv_dtype == torch.float8_e4m3fn:
        source = "default"  # e4m3 spans +-448: 1.0 is the usual default (vLLM's too)
    else:
        start = time.perf_counter()
        prompts = startup_calibration_prompts(config)
        amax = calibrate_kv_amax(model, prompts, dtype=resolve_dtype(config.dtype),
                                 device=config.device, block_size=config.cache.block_size,
                                 max_batch_tokens=config.scheduler.max_num_tokens)
        set_kv_scales(layers, amax, kv_dtype, only_missing=True)
        source = "calibrated"
        logger.info("int8 KV cache: no scales in the checkpoint; calibrated on %d prompts "
                    "(%d tokens) in %.2f s", len(prompts), sum(map(len, prompts)),
                    time.perf_counter() - start)
    ks = [a.k_scale.item() for a in layers]
    vs = [a.v_scale.item() for a in layers]
    logger.info("%s KV cache, scales from %s: k_scale %.4g..%.4g, v_scale %.4g..%.4g over %d "
                "layers", kv_dtype_name(kv_dtype), source, min(ks), max(ks), min(vs), max(vs),
                len(layers))
    return source
