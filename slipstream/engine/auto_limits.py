"""Step limits chosen from the device and the model when the user leaves them unset ("auto").

`max_num_seqs` (the running batch) and `max_num_tokens` (the token budget of a step) decide
how much of a GPU a step uses. Too small, and decode GEMMs stay memory-bound and prefills trickle
in a few prompts a step; too large, and the KV cache cannot hold the batch (preemptions) or the
activations of a step eat the memory the KV cache needed. `choose_step_limits` is a pure
function of the device class, the model's memory footprint and the memory budget; the engine
calls it before the KV cache is sized, then `fit_to_kv_cache` once the cache it really got is
known. A value the user set is never changed. See docs/configuration.md.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from slipstream.config import EngineConfig

logger = logging.getLogger(__name__)

GIB = 2**30


@dataclass(frozen=True)
class StepLimits:
    max_num_seqs: int
    max_num_tokens: int


@dataclass(frozen=True)
class DeviceInfo:
    """What the choice needs to know of a device: its kind, memory and SM count."""

    kind: str  # "cuda" or "cpu"
    total_memory: int = 0  # bytes
    sm_count: int = 0
    name: str = ""


@dataclass(frozen=True)
class ModelFootprint:
    """Bytes one rank holds: weights, K and V of one token, activations of one token in a step."""

    weight_bytes: int
    kv_bytes_per_token: int
    activation_bytes_per_token: int


# A CPU (and any unknown device) keeps the small limits: a step there is compute-bound already.
CPU_LIMITS = StepLimits(max_num_seqs=128, max_num_tokens=2048)

# GPU classes, largest first: (at least this many SMs, at least this much memory in GiB, limits).
# Big data-centre GPUs (H100, H200, A100 80 GB, B200): decode GEMMs of an 8B model stop being
# memory-bound near 200 rows, and a batch of 512 also spreads the host's per-step cost; a
# budget of 8,192 tokens admits 60+ short prompts a step. Mid-size GPUs (A10, L4, L40S,
# A100 40 GB) have a third to half of that compute. Smaller ones (T4) keep the CPU's limits.
_GPU_CLASSES = (
    (100, 60, StepLimits(max_num_seqs=512, max_num_tokens=8192)),
    (48, 20, StepLimits(max_num_seqs=256, max_num_tokens=4096)),
)

# At most this share of the memory left after the weights goes to one step's activations.
ACTIVATION_SHARE = 0.1
# The batch must fit the KV cache with this many tokens a sequence (a short request: 128 in,
# 128 out); longer requests make the scheduler run fewer at once, as it should.
KV_TOKENS_PER_SEQ = 256
MIN_TOKENS = 256  # never a smaller token budget than this (a prompt would need many chunks)
GRAPH_STEP = 16  # decode graphs are captured for every multiple of 16: a batch on that grid


def choose_step_limits(
    device: DeviceInfo, model: ModelFootprint, gpu_memory_utilization: float = 0.9
) -> StepLimits:
    """The limits for this device and model before the KV cache is sized: the device class's,
    then lowered so one step's activations take at most ACTIVATION_SHARE of the memory left
    after the weights and the KV cache left holds the batch (KV_TOKENS_PER_SEQ a sequence)."""
    if device.kind != "cuda":
        return CPU_LIMITS
    limits = _device_class(device)
    free = int(gpu_memory_utilization * device.total_memory) - model.weight_bytes
    if free <= 0:  # the weights alone do not fit: loading will say so
        return StepLimits(GRAPH_STEP, MIN_TOKENS)
    act_tokens = int(free * ACTIVATION_SHARE) // max(model.activation_bytes_per_token, 1)
    tokens = max(MIN_TOKENS, min(limits.max_num_tokens, _floor_pow2(act_tokens)))
    kv_tokens = (free - tokens * model.activation_bytes_per_token) // max(model.kv_bytes_per_token, 1)
    return fit_to_kv_cache(StepLimits(limits.max_num_seqs, tokens), kv_tokens)


def fit_to_kv_cache(limits: StepLimits, kv_tokens: int) -> StepLimits:
    """Limits no larger than a KV cache of `kv_tokens` tokens can use: a batch of
    KV_TOKENS_PER_SEQ-token sequences (on the graph grid), a step of at most the whole cache."""
    seqs = max(kv_tokens, 0) // KV_TOKENS_PER_SEQ
    if seqs >= GRAPH_STEP:
        seqs -= seqs % GRAPH_STEP
    tokens = _floor_pow2(max(kv_tokens, 0))
    return StepLimits(
        max_num_seqs=max(1, min(limits.max_num_seqs, seqs)),
        max_num_tokens=max(min(MIN_TOKENS, limits.max_num_tokens), min(limits.max_num_tokens, tokens)),
    )


def _device_class(device: DeviceInfo) -> StepLimits:
    for min_sms, min_gib, limits in _GPU_CLASSES:
        if device.sm_count >= min_sms and device.total_memory >= min_gib * GIB:
            return limits
    return CPU_LIMITS


def _floor_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


# ---- the engine's side: read the device and the model, fill what the user left unset -------


def resolve_step_limits(config: EngineConfig) -> EngineConfig:
    """config with max_num_seqs / max_num_tokens chosen where they are None (auto); logs them."""
    sched = config.scheduler
    if sched.max_num_seqs is not None and sched.max_num_tokens is not None:
        return config
    device = device_info(config.device)
    chosen = choose_step_limits(device, model_footprint(config), config.cache.gpu_memory_utilization)
    config = _with_limits(config, chosen)
    logger.info(
        "step limits: max_num_seqs=%d, max_num_tokens=%d (%s for %s%s)",
        config.scheduler.max_num_seqs,
        config.scheduler.max_num_tokens,
        "chosen" if sched.max_num_seqs is None and sched.max_num_tokens is None else "partly chosen",
        device.name or device.kind,
        f", {device.total_memory / GIB:.0f} GiB, {device.sm_count} SMs" if device.kind == "cuda" else "",
    )
    return config


def fit_resolved_limits(config: EngineConfig, asked, num_blocks: int) -> EngineConfig:
    """After the KV cache is sized: lower the limits the user left unset (`asked`: the
    SchedulerConfig before resolution) to what `num_blocks` blocks can hold."""
    if asked.max_num_seqs is not None and asked.max_num_tokens is not None:
        return config
    if config.device.startswith("cpu") or config.runner == "pooling":
        # The CPU's fixed limits (its 1 GiB cache holds them); a pooling engine's cache is
        # sized from the limits (one step of whole prompts), not the other way round.
        return config
    sched = config.scheduler
    fitted = fit_to_kv_cache(
        StepLimits(sched.max_num_seqs, sched.max_num_tokens), num_blocks * config.cache.block_size
    )
    changed = _with_limits(config, fitted, only_auto=asked)
    new = changed.scheduler
    if (new.max_num_seqs, new.max_num_tokens) != (sched.max_num_seqs, sched.max_num_tokens):
        logger.info(
            "step limits fitted to the KV cache (%d tokens): max_num_seqs=%d, max_num_tokens=%d",
            num_blocks * config.cache.block_size,
            new.max_num_seqs,
            new.max_num_tokens,
        )
    return changed


def _with_limits(config: EngineConfig, limits: StepLimits, only_auto=None) -> EngineConfig:
    sched = config.scheduler
    auto = only_auto or sched
    seqs = limits.max_num_seqs if auto.max_num_seqs is None else sched.max_num_seqs
    tokens = limits.max_num_tokens if auto.max_num_tokens is None else sched.max_num_tokens
    return config.replace(scheduler=dataclasses.replace(sched, max_num_seqs=seqs, max_num_tokens=tokens))


def device_info(device: str) -> DeviceInfo:
    if not device.startswith("cuda"):
        return DeviceInfo(kind="cpu")
    import torch

    props = torch.cuda.get_device_properties(torch.device(device))
    return DeviceInfo(
        kind="cuda", total_memory=props.total_memory, sm_count=props.multi_processor_count, name=props.name
    )


def model_footprint(config: EngineConfig) -> ModelFootprint:
    """One rank's weights (the loader's estimate; 2 bytes a parameter where the size
    arithmetic does not cover the model), K/V bytes a token and activation bytes a token."""
    from slipstream.models.sizes import count_parameters, weight_bytes
    from slipstream.parallel.sharding import kv_heads_per_rank
    from slipstream.quantization.kv_cache import resolve_kv_cache_dtype

    m, world = config.model, config.parallel.world_size
    tp = config.parallel.tensor_parallel_size
    dtype = str(config.dtype).removeprefix("torch.")
    try:
        weights = weight_bytes(m.hf_config, dtype, config.quant.method, config.quant.lm_head)
    except (KeyError, ValueError):
        try:
            weights = 2 * count_parameters(m.hf_config)
        except (KeyError, ValueError):
            weights = 0
    elem = 4 if dtype == "float32" else 2
    kv_elem = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype, m.hf_config).itemsize
    layers = m.num_hidden_layers // config.parallel.pipeline_parallel_size
    kv = 2 * layers * kv_heads_per_rank(m.num_key_value_heads, tp) * m.head_dim * kv_elem
    # Residual, hidden and attention output, the gate/up product and its activation.
    act = elem * (4 * m.hidden_size + 3 * m.intermediate_size // tp)
    return ModelFootprint(
        weight_bytes=weights // world, kv_bytes_per_token=kv, activation_bytes_per_token=act
    )
