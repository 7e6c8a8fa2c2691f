"""Loading a built engine directory: its settings become the engine's, what a caller asks is
checked against them, and its weights and compiled kernels are used as they are."""
from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.build.manifest import (
    MANIFEST,
    EngineMismatchError,
    check_environment,
    read_manifest,
    rebuild_hint,
)

if TYPE_CHECKING:
    from slipstream.config import EngineConfig
    from slipstream.engine.args import EngineArgs

logger = logging.getLogger(__name__)

# Settings fixed by the build: a caller may leave them at their default or repeat them.
_FIXED = ("dtype", "quantization", "kv_cache_dtype", "tensor_parallel_size", "block_size")
# Limits a caller may lower, never raise.
_LIMITS = ("max_model_len", "max_num_seqs", "max_num_tokens")


def is_engine_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def engine_args(args: EngineArgs, engine_dir: str | Path) -> tuple[EngineArgs, dict[str, Any]]:
    """(args with the build's settings and limits filled in, the manifest); EngineMismatchError
    when this machine or what args asks differs from the build."""
    manifest = read_manifest(engine_dir)
    settings = manifest["settings"]
    device = _device(args.device, settings["device"], manifest, engine_dir)
    check_environment(manifest, engine_dir, device)
    defaults = {f.name: f.default for f in dataclasses.fields(type(args))}
    changes: dict[str, Any] = {"device": device}
    problems = []
    for name in _FIXED:
        asked, built = getattr(args, name), settings[name]
        if asked in (defaults[name], "auto", None, built):
            changes[name] = built
        else:
            problems.append(f"{name}={asked!r} (built with {built!r})")
    head = args.quantize_lm_head
    if head is None or _head_format(head, settings["quantization"]) == settings["lm_head"]:
        changes["quantize_lm_head"] = settings["lm_head"] or False
    else:
        problems.append(f"quantize_lm_head={head!r} (built with {settings['lm_head']!r})")
    for name in _LIMITS:
        asked, built = getattr(args, name), manifest["limits"][name]
        if asked is None or asked == defaults[name]:
            changes[name] = built
        elif asked > built:
            problems.append(f"{name}={asked} (built for at most {built})")
    if problems:
        raise EngineMismatchError(f"engine {engine_dir} cannot serve " + ", ".join(problems)
                                  + f": ask for the built values or less, or build again with "
                                  f"them. {rebuild_hint(manifest, engine_dir)}")
    return dataclasses.replace(args, **changes), manifest


def _device(asked: str, built: str, manifest: dict[str, Any], engine_dir: str | Path) -> str:
    if asked == "auto":
        return built
    if asked.split(":")[0] != built.split(":")[0]:
        raise EngineMismatchError(f"engine {engine_dir} was built for {built}, not {asked}. "
                                  f"{rebuild_hint(manifest, engine_dir)}")
    return asked


def _head_format(choice: Any, method: str | None) -> str | None:
    from slipstream.quantization.lm_head import head_format

    return head_format(choice, method)


def planned_config(config: EngineConfig, args: EngineArgs,
                   manifest: dict[str, Any]) -> EngineConfig:
    """The config loading `manifest`'s engine: its weights as saved, and its KV-cache size
    unless the caller set a budget of its own (kv_cache_memory or gpu_memory_utilization)."""
    cache = config.cache
    plan = manifest["memory_plan"]
    if args.kv_cache_memory is None and args.gpu_memory_utilization == plan["gpu_memory_utilization"]:
        cache = dataclasses.replace(cache, num_blocks=plan["num_blocks"])
    return config.replace(load_format="engine", cache=cache)


def load_engine_weights(model: Any, config: EngineConfig) -> None:
    import torch

    from slipstream.build.weights import load_runtime_weights

    manifest = read_manifest(config.model_path)
    load_runtime_weights(model, config.model_path, manifest["runtime"],
                         torch.device(config.device), config.quant.lm_head)


def use_engine_kernels(engine_dir: str | Path) -> Path:
    """Copy the engine's Triton kernels into Triton's cache (where Triton looks for them; a
    kernel already there is kept) and return the folder of its NVRTC binaries."""
    src = Path(engine_dir) / "triton_cache"
    if src.is_dir():
        dst = triton_cache_dir()
        try:
            for entry in src.iterdir():
                if entry.is_dir() and not (dst / entry.name).exists():
                    shutil.copytree(entry, dst / entry.name)
        except OSError as exc:  # a read-only home: Triton compiles them again
            logger.warning("could not copy the engine's Triton kernels to %s: %s", dst, exc)
    return Path(engine_dir) / "nvrtc"


def triton_cache_dir() -> Path:
    """The directory Triton reads its compiled kernels from."""
    from slipstream import envs

    if envs.TRITON_CACHE_DIR.get():
        return Path(envs.TRITON_CACHE_DIR.get()).expanduser()
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):
        return Path.home() / ".triton" / "cache"
