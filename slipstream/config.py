"""Frozen configuration dataclasses: every limit of an engine lives here.

`EngineConfig` bundles the parts; `EngineConfig.create(...)` is the one place that fills
defaults from a model directory and checks that the limits agree with each other.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slipstream.pooling.config import PoolerConfig
from slipstream.quantization.modelopt import with_hf_quant_config
from slipstream.speculative.config import SpeculativeConfig


@dataclass(frozen=True)
class ModelConfig:
    """What the checkpoint says about the network (read from config.json)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k and v
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @staticmethod
    def from_hf_dict(cfg: dict[str, Any]) -> ModelConfig:
        cfg = _with_standard_names(cfg)
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else cfg.get("model_type", "unknown")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        model_type = cfg.get("model_type", "")
        return ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=_with_original_len(
                cfg.get("rope_scaling") or _rope_params_scaling(cfg.get("rope_parameters")), cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type in ("qwen2", "qwen2_moe"))),
            qk_norm=model_type == "qwen3" or arch.startswith("Qwen3"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            hf_config=cfg,
        )

    @staticmethod
    def from_dir(path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path!s}")
        return ModelConfig.from_hf_dict(with_hf_quant_config(json.loads(cfg_path.read_text()), path))


# GPT-2's config names -> the standard ones (rms_norm_eps then holds its LayerNorm epsilon).
_NAME_ALIASES = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers",
                 "n_head": "num_attention_heads", "n_positions": "max_position_embeddings",
                 "layer_norm_epsilon": "rms_norm_eps"}


def _with_standard_names(cfg: dict[str, Any]) -> dict[str, Any]:
    text = cfg.get("text_config")
    if isinstance(text, dict) and "num_attention_heads" not in cfg:
        # A multimodal checkpoint served as text (Gemma 3): its language model's settings, under
        # the checkpoint's own architecture name.
        cfg = {**text, "architectures": cfg.get("architectures") or text.get("architectures"),
               "tie_word_embeddings": cfg.get("tie_word_embeddings",
                                              text.get("tie_word_embeddings", True)),
               "quantization_config": cfg.get("quantization_config")}
        cfg = {k: v for k, v in cfg.items() if v is not None}
    if not any(alias in cfg for alias in _NAME_ALIASES):
        return cfg
    out = dict(cfg)
    for alias, name in _NAME_ALIASES.items():
        if alias in cfg and name not in cfg:
            out[name] = cfg[alias]
    if "intermediate_size" not in out and "hidden_size" in out:
        out["intermediate_size"] = cfg.get("n_inner") or 4 * out["hidden_size"]
    return out


def _with_original_len(scaling: dict[str, Any] | None, cfg: dict[str, Any]
                       ) -> dict[str, Any] | None:
    """Phi-3 keeps original_max_position_embeddings beside rope_scaling, not in it."""
    if scaling and "original_max_position_embeddings" not in scaling \
            and cfg.get("original_max_position_embeddings"):
        return {**scaling, "original_max_position_embeddings":
                cfg["original_max_position_embeddings"]}
    return scaling


def _rope_params_scaling(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """transformers >= 5 stores rope scaling in `rope_parameters`; keep only real scaling."""
    if not params or params.get("rope_type", "default") == "default":
        return None
    return dict(params)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None  # bytes; None -> derived (CPU: 1 GiB, GPU: profiling)
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None  # filled in by the engine once memory is known
    kv_cache_dtype: str = "auto"
    # Host KV tier (kv_cache/host_tier.py): bytes of host memory (pinned on CUDA) for cached
    # blocks evicted from the device; num_host_blocks is filled in by the engine.
    kv_cache_host_memory: int | None = None
    num_host_blocks: int = 0
    # "auto": host blocks are copied back (and requests swapped) only where the measured cost
    # model finds a copy cheaper than recomputing (kv_cache/tier_cost.py); "always": always.
    kv_offload_mode: str = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    # Max batch size and token budget per step; None (auto) until the engine chooses them at
    # start-up (engine/auto_limits.py).
    max_num_seqs: int | None = 128
    max_num_tokens: int | None = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # Decode steps run back to back on the GPU without a host round trip (pure-decode batches
    # of greedy requests only); 1 = a host round trip every token.
    decode_steps: int = 1
    # With decode_steps > 1: queue the next multi-step decode of an unchanged batch before
    # reading the tokens of the one running, so the GPU never waits for the host between them.
    pipeline_decode: bool = True
    # Schedule and launch each step before reading the previous step's sampled tokens (fed to
    # it on the device), when no request needs its tokens on the host first (EngineArgs turns
    # it on for CUDA).
    async_scheduling: bool = False
    # When blocks run out: "recompute" frees the victim's blocks to the prefix cache, "swap"
    # also copies them to the host KV tier at once; "auto" swaps long requests when a host
    # tier exists.
    preemption_mode: str = "auto"


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # MoE models: experts placed across the tensor-parallel ranks instead of each expert's
    # weights split across them (docs/parallelism.md: the expert-parallel hook).
    enable_expert_parallel: bool = False
    # "mp" (worker processes on this machine) or "ray" (Ray actors, across nodes). None: the
    # model runs in the engine's own process when one rank suffices, else on "mp" workers.
    distributed_executor_backend: str | None = None

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def uses_workers(self) -> bool:
        """Whether the model runs on worker ranks (engine/distributed.py) rather than in the
        engine's own process: several ranks, or a backend asked for by name."""
        return self.world_size > 1 or self.distributed_executor_backend is not None


@dataclass(frozen=True)
class QuantConfig:
    method: str | None = None
    lm_head: str | None = None  # the LM head's format when quantized too (opt-in): fp8 / int8_wo


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving (slipstream/lora/): off unless enabled."""

    enabled: bool = False
    max_loras: int = 4  # adapters on the device at once (slots a batch can mix)
    max_lora_rank: int = 16  # largest adapter rank accepted (slot buffers are this wide)
    max_cpu_loras: int = 4  # adapters kept read on the host (at least max_loras)


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = ParallelConfig()
    quant: QuantConfig = QuantConfig()
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    load_format: str = "auto"  # "auto" (safetensors) or "dummy" (random weights)
    enforce_eager: bool = False
    tokenizer_path: str | None = None
    # Prefill steps of at most this many tokens (up to 64 sequences) replay a CUDA graph (0: never).
    max_prefill_graph_tokens: int = 512
    # CPU engine: torch's intra-op threads (None: physical cores less busy ones; runner/cpu_threads.py).
    cpu_threads: int | None = None
    # Speculative decoding (speculative/); None: off.
    speculative: SpeculativeConfig | None = None
    # Constrained requests: grammar-forced tokens verified as drafts, at most this many a step (0: off).
    grammar_forced_drafts: int = 0
    lora: LoRAConfig = LoRAConfig()
    # "generate" (text) or "pooling" (embeddings / classification: pooling/, with `pooler`).
    runner: str = "generate"
    pooler: PoolerConfig | None = None

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)
