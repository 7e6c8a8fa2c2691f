"""An engine's manifest (engine.json): where and for what it was built, and the check that this
machine and these versions can run it."""
from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path
from typing import Any

MANIFEST = "engine.json"
FORMAT = 1
# Compared on every load: what the weights' layout, the tuned kernel choices and the compiled
# kernels depend on. A CPU build depends only on the first three.
_CPU_KEYS = ("device", "slipstream", "torch")
_GPU_KEYS = _CPU_KEYS + ("gpu_name", "compute_capability", "triton", "cuda")


class EngineMismatchError(ValueError):
    """A built engine cannot run here (another GPU, other versions, a limit above the built)."""


def environment(device: str) -> dict[str, Any]:
    """The machine and software an engine is built for (device: "cpu" or "cuda[:i]")."""
    import torch

    from slipstream import __version__

    env: dict[str, Any] = {"device": "cuda" if device.startswith("cuda") else "cpu",
                           "slipstream": __version__, "torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if env["device"] == "cuda":
        dev = torch.device(device)
        major, minor = torch.cuda.get_device_capability(dev)
        env.update(gpu_name=torch.cuda.get_device_name(dev),
                   compute_capability=f"{major}.{minor}", cuda=torch.version.cuda)
    return env


def read_manifest(engine_dir: str | Path) -> dict[str, Any]:
    path = Path(engine_dir) / MANIFEST
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise EngineMismatchError(f"{path}: engine format {data.get('format')!r}, this slipstream "
                                  f"reads format {FORMAT}; {rebuild_hint(data, engine_dir)}")
    return data


def write_manifest(engine_dir: Path, manifest: dict[str, Any]) -> None:
    (engine_dir / MANIFEST).write_text(json.dumps({"format": FORMAT, **manifest}, indent=2) + "\n")


def check_environment(manifest: dict[str, Any], engine_dir: str | Path, device: str) -> None:
    """EngineMismatchError naming every difference between the build's machine and this one."""
    built = manifest["environment"]
    here = environment(device)
    keys = _GPU_KEYS if built["device"] == "cuda" and here["device"] == "cuda" else _CPU_KEYS
    diffs = [f"{k}: built with {built.get(k)!r}, here {here.get(k)!r}" for k in keys
             if built.get(k) != here.get(k)]
    if diffs:
        raise EngineMismatchError(f"engine {engine_dir} was built for another setup ("
                                  + "; ".join(diffs) + f"). {rebuild_hint(manifest, engine_dir)}")


def rebuild_hint(manifest: dict[str, Any], engine_dir: str | Path) -> str:
    """The command that builds this engine again on this machine."""
    argv = manifest.get("build_args") or []
    command = shlex.join(["slipstream", "build", *argv]) if argv else \
        f"slipstream build --model SOURCE --output {engine_dir}"
    return f"Rebuild it here: {command}"


def checkpoint_hash(path: str | Path) -> str:
    """sha256 over the source checkpoint's files (config, weights, shard index; or a GGUF
    file), names and contents, in name order."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(
        f for f in p.iterdir() if f.is_file() and (f.suffix in (".safetensors", ".gguf")
                                                   or f.name in ("config.json",
                                                                 "model.safetensors.index.json")))
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            digest.update(hashlib.file_digest(fh, "sha256").digest())
    return digest.hexdigest()
