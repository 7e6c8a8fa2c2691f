"""`slipstream build`: prepare a model once for this GPU, precision and limits, and write it as an
engine directory that later starts load without conversion or tuning.

The build starts a real engine with the requested settings (load, quantize, fold norms, size the
KV cache, warm up, tune, capture), then writes what that start produced:

    engine.json         manifest: machine and versions, settings, limits, memory plan, graph sizes,
                        source checkpoint hash, start-up phases of the build
    config.json         the model's configuration; tokenizer and generation files of the source
    model*.safetensors  the weights in the runtime layout (build/weights.py)
    tuning.json         kernel choices measured for these shapes (kernels/runtime/tuning_cache.py)
    triton_cache/       Triton kernels compiled during the build (CUDA)
    nvrtc/              CUDA C++ kernels compiled during the build (CUDA)
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from slipstream import envs
from slipstream.build.engine_dir import is_engine_dir
from slipstream.build.manifest import checkpoint_hash, environment, write_manifest

logger = logging.getLogger(__name__)

# Source files that are weights or written anew; everything else (tokenizer, generation config,
# chat template, modelopt's hf_quant_config.json) is copied.
_NOT_COPIED = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
_WRITTEN = ("config.json", "model.safetensors.index.json")


def build(model: str | None = None, output: str | os.PathLike = "engine", *,
          overwrite: bool = False, build_args: list[str] | None = None,
          **engine_kwargs: Any) -> Path:
    """Build `model` (a checkpoint directory or GGUF file; None: the default model) into the
    engine directory `output` and return its path. engine_kwargs are EngineArgs fields
    (quantization, kv_cache_dtype, dtype, device, max_model_len, max_num_seqs, ...).

    overwrite: replace an existing engine at `output` (any other existing file or non-empty
    directory is never replaced). The engine is written beside `output` and moved into place
    at the end, so a failed build leaves no half-written engine."""
    from slipstream.engine.args import EngineArgs

    args = EngineArgs(model=model, **engine_kwargs)
    out = Path(output)
    _check_output(out, overwrite)
    if args.model is not None and is_engine_dir(args.model):
        raise ValueError(f"{args.model} is already a built engine; build from its source "
                         "checkpoint")
    config = args.create_engine_config()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        _write_engine(tmp, config, args, build_args or _as_cli_args(args, out))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("engine written to %s", out)
    return out


def _check_output(out: Path, overwrite: bool) -> None:
    if not out.exists():
        return
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
        return
    if not is_engine_dir(out):
        raise ValueError(f"{out} exists and is not an engine directory: choose another output")
    if not overwrite:
        raise ValueError(f"{out} already holds an engine: pass overwrite=True (--overwrite) to "
                         "replace it")


def _write_engine(tmp: Path, config, args, build_args: list[str]) -> None:
    from slipstream.engine.core import EngineCore

    with _compiling_into(tmp, config.device):
        core = EngineCore(config)
    try:
        runtime = _save_model(core, tmp)
        _write_tuning(tmp)
        _copy_source_files(config, tmp)
        write_manifest(tmp, _manifest(core, config, args, runtime, build_args))
    finally:
        del core
        gc.collect()
        _empty_device_cache(config.device)


@contextlib.contextmanager
def _compiling_into(tmp: Path, device: str) -> Iterator[None]:
    """On CUDA, kernels compiled while the engine starts go into the engine directory: Triton's
    cache and the NVRTC binaries (a kernel this process compiled before is already in memory
    and is not written: build in a fresh process, as the CLI does, for a complete cache)."""
    if not device.startswith("cuda"):
        yield
        return
    from slipstream.engine import startup

    name = envs.TRITON_CACHE_DIR.name
    previous = os.environ.get(name)
    os.environ[name] = str(tmp / "triton_cache")
    token = startup.BUILD_DIR.set(tmp)
    try:
        yield
    finally:
        startup.BUILD_DIR.reset(token)
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _save_model(core, tmp: Path) -> dict[str, Any]:
    from slipstream.build.weights import save_runtime_weights

    return save_runtime_weights(core.runner.model, tmp)


def _write_tuning(tmp: Path) -> None:
    from slipstream.kernels.runtime import tuning_cache

    (tmp / "tuning.json").write_text(json.dumps(tuning_cache.snapshot()) + "\n")


def _copy_source_files(config, tmp: Path) -> None:
    """config.json (the configuration the engine ran with), then the source's other files and
    the tokenizer's, weights excepted."""
    (tmp / "config.json").write_text(json.dumps(config.model.hf_config, indent=2) + "\n")
    dirs = [Path(p) for p in (config.model_path, config.tokenizer_path) if p]
    for d in dict.fromkeys(p for p in dirs if p.is_dir()):
        for f in d.iterdir():
            if (f.is_file() and f.suffix not in _NOT_COPIED and f.name not in _WRITTEN
                    and not (tmp / f.name).exists()):
                shutil.copy2(f, tmp / f.name)
    tokenizer = config.tokenizer_path or config.model_path
    if Path(tokenizer).is_file():  # a GGUF file's tokenizer, written as Hugging Face files
        from slipstream.tokenizer.tokenizer import maybe_load_tokenizer

        loaded = maybe_load_tokenizer(tokenizer)
        if loaded is not None:
            loaded.hf.save_pretrained(str(tmp))


def _manifest(core, config, args, runtime: dict[str, Any], build_args: list[str]
              ) -> dict[str, Any]:
    runner, sched = core.runner, core.config.scheduler  # the limits in force (auto: chosen)
    num_blocks = core.config.cache.num_blocks
    graphs = getattr(runner, "_graphs", None)
    prefill = getattr(runner, "_prefill_graphs", None)
    return {
        "environment": environment(config.device),
        "source": {"path": str(Path(config.model_path).resolve()),
                   "sha256": checkpoint_hash(config.model_path)},
        "settings": {"device": "cuda" if config.device.startswith("cuda") else "cpu",
                     "dtype": config.dtype, "quantization": config.quant.method,
                     "lm_head": config.quant.lm_head,
                     "kv_cache_dtype": config.cache.kv_cache_dtype,
                     "kv_cache_storage": str(runner.kv_cache_dtype).removeprefix("torch."),
                     "tensor_parallel_size": config.parallel.tensor_parallel_size,
                     "block_size": config.cache.block_size},
        "limits": {"max_model_len": sched.max_model_len, "max_num_seqs": sched.max_num_seqs,
                   "max_num_tokens": sched.max_num_tokens},
        "memory_plan": {"num_blocks": num_blocks,
                        "kv_cache_bytes": num_blocks * runner.kv_cache_bytes_per_block(),
                        "weight_bytes": runtime["weight_bytes"],
                        "gpu_memory_utilization": args.gpu_memory_utilization},
        "cuda_graph_batch_sizes": list(graphs.sizes) if graphs is not None else [],
        "prefill_graph_tokens": list(prefill.sizes) if prefill is not None else [],
        "runtime": runtime,
        "build_startup_phases": core.startup_phases,
        "build_args": build_args,
    }


def _as_cli_args(args, out: Path) -> list[str]:
    """`slipstream build` flags that repeat this build (the rebuild hint of a mismatch)."""
    flags = ["--model", str(args.model) if args.model else "", "--output", str(out)]
    flags = flags[2:] if not args.model else flags
    for name in ("quantization", "kv_cache_dtype", "dtype", "max_model_len", "max_num_seqs",
                 "max_num_tokens", "block_size"):
        value = getattr(args, name)
        if value is not None and value != "auto":
            flags += [f"--{name.replace('_', '-')}", str(value)]
    if args.quantize_lm_head not in (None, False):
        flags += ["--quantize-lm-head"] + ([] if args.quantize_lm_head is True
                                           else [str(args.quantize_lm_head)])
    return flags


def _empty_device_cache(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
