"""The naive baseline: the same requests through Hugging Face transformers `generate`.

Static batches, left-padded, greedy, every request forced to generate exactly to its batch's
longest output (min_new_tokens = max_new_tokens); only each request's own output length counts as
useful tokens. The model is built from the same config.json with random weights in the same
dtype, directly on the device.
"""
from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from slipstream.bench.datasets import BenchRequest

_TORCH_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class HFResult:
    name: str
    batch_size: int
    num_requests: int
    num_batches: int
    useful_output_tokens: int
    generated_tokens: int  # including tokens past a request's own length in its batch
    total_input_tokens: int
    wall_time_s: float
    output_tok_s: float
    total_tok_s: float
    peak_gpu_memory_gib: float | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_hf_model(model_dir: str | Path, dtype: str, device: str):
    """Random-weight transformers model of the checkpoint's config, built on `device`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"HF baseline dtype must be one of {_TORCH_DTYPES}, got {dtype!r}")
    from slipstream.models.gguf import gguf_hf_config, is_gguf_file

    if is_gguf_file(model_dir):  # its metadata as the config.json it stands for
        fields = gguf_hf_config(model_dir)
        fields.pop("gguf")
        if (fields.get("rope_scaling") or {}).get("rope_type") == "freq_factors":
            # llama.cpp's per-frequency RoPE divisors have no transformers spelling; the
            # baseline's random weights time the same with the default RoPE.
            fields.pop("rope_scaling")
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    else:
        config = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
    torch_dtype = getattr(torch, dtype)
    # Building under the device context allocates and initialises the weights there: an 8B
    # model initialised on the host would take minutes.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    return model.eval()


def _left_pad(batch: list[BenchRequest], pad_id: int, device: str):
    import torch

    width = max(r.input_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, req in enumerate(batch):
        ids[row, width - req.input_len:] = torch.tensor(req.prompt_token_ids)
        mask[row, width - req.input_len:] = 1
    return ids.to(device), mask.to(device)


def generate_batch(model, batch: list[BenchRequest], device: str, pad_id: int = 0) -> int:
    """One static batch; returns the number of new tokens per row (all rows the same)."""
    import torch

    ids, mask = _left_pad(batch, pad_id, device)
    new_tokens = max(r.output_len for r in batch)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             pad_token_id=pad_id, num_beams=1)
    generated = out.shape[1] - ids.shape[1]
    if generated != new_tokens:
        raise RuntimeError(f"HF generate stopped at {generated} of {new_tokens} tokens")
    return generated


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_hf_baseline(model_dir: str | Path, requests: list[BenchRequest], *, dtype: str,
                    device: str, batch_size: int = 64, warmup: bool = True) -> HFResult:
    """Time `requests` (in order, in static batches) through HF generate; frees the model."""
    import torch

    if batch_size < 1:
        raise ValueError(f"HF batch size must be positive, got {batch_size}")
    model = build_hf_model(model_dir, dtype, device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    if warmup:  # CUDA context, cuBLAS handles and kernel caches outside the timed region
        generate_batch(model, [BenchRequest(requests[0].prompt_token_ids[:8], 2)], device)
    batches = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    _sync(device)
    start = time.perf_counter()
    generated = sum(generate_batch(model, b, device) * len(b) for b in batches)
    _sync(device)
    wall = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    del model
    free_device_memory(device)
    useful = sum(r.output_len for r in requests)
    total_in = sum(r.input_len for r in requests)
    return HFResult(
        name="hf", batch_size=batch_size, num_requests=len(requests), num_batches=len(batches),
        useful_output_tokens=useful, generated_tokens=generated, total_input_tokens=total_in,
        wall_time_s=wall, output_tok_s=useful / wall, total_tok_s=(useful + total_in) / wall,
        peak_gpu_memory_gib=peak,
    )


def free_device_memory(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
