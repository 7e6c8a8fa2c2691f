"""LoRA parts without an engine: slot pinning (scheduler side) and adapters in the fused layout."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from slipstream.config import ModelConfig
from slipstream.lora.adapter import load_adapter
from slipstream.lora.slots import LoRASlots
from tests.lora.peft_adapters import make_adapter


def test_slots_pin_reuse_and_evict_least_recently_used() -> None:
    slots = LoRASlots(2)
    a = slots.acquire(1)
    b = slots.acquire(2)
    assert {a, b} == {0, 1}
    assert slots.acquire(1) == a  # resident: the same slot, pinned twice
    assert slots.acquire(3) is None  # every slot pinned: the request waits
    slots.release(b)
    assert slots.acquire(3) == b and not slots.holds(2)  # the unpinned slot is reused
    slots.release(a)
    slots.release(b)
    assert slots.acquire(2) == b  # adapter 1 still pins slot a once, so b (3) is evicted
    slots.release(a)
    assert slots.num_pinned == 1
    with pytest.raises(RuntimeError, match="released more often"):
        slots.release(a)


def test_fused_qkv_adapter_equals_separate_q_k_v(tiny_llama_dir, tmp_path) -> None:
    """An adapter trained on a fused qkv_proj (one A, stacked B) gives the same product as
    q/k/v adapters sharing that A with B's slices."""
    src = make_adapter(tiny_llama_dir, tmp_path / "sep", ["q_proj", "k_proj", "v_proj"], 4)
    tensors = load_file(str(src / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.self_attn."
    shared_a = tensors[prefix + "q_proj.lora_A.weight"]
    for name in ("k_proj", "v_proj"):
        tensors[prefix + f"{name}.lora_A.weight"] = shared_a.clone()
    save_file(tensors, str(src / "adapter_model.safetensors"))
    fused = tmp_path / "fused"
    fused.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (fused / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["qkv_proj"]}))
    stacked_b = torch.cat([tensors[prefix + f"{n}.lora_B.weight"] for n in ("q_proj", "k_proj",
                                                                            "v_proj")])
    save_file({prefix + "qkv_proj.lora_A.weight": shared_a,
               prefix + "qkv_proj.lora_B.weight": stacked_b},
              str(fused / "adapter_model.safetensors"))
    model_cfg = ModelConfig.from_dir(tiny_llama_dir)
    sep = load_adapter(1, src, model_cfg, 8, torch.float32).images[(0, "qkv")]
    one = load_adapter(2, fused, model_cfg, 8, torch.float32).images[(0, "qkv")]
    x = torch.randn(3, shared_a.shape[1])

    def product(image):  # y[:, shard j] = (x A_j^T) B[shard j]^T
        a, b = image
        starts = [0, 64, 96, 128]
        return torch.cat([(x @ a[j].T) @ b[starts[j]:starts[j + 1]].T for j in range(3)], dim=1)

    torch.testing.assert_close(product(one), product(sep))


def test_lora_linear_on_the_triton_kernels_matches_the_reference() -> None:
    """LoRALinear's glue (layout, the shared shrink workspace zeroed once a forward by its first
    projection) with the Triton kernels (the interpreter here; only a GPU engine picks them)
    gives the reference twins' products, at one row (K split: atomic adds into the workspace)
    and at more."""
    from types import SimpleNamespace

    import numpy as np

    from slipstream.kernels.lora import reference
    from slipstream.kernels.lora import triton_lora as tk
    from slipstream.kernels.lora.meta import meta_views, pack_meta
    from slipstream.lora.layers import LoRALinear, LoRAState

    torch.manual_seed(3)
    cpu = torch.device("cpu")
    state = LoRAState(num_slots=2, max_tokens=32, device=cpu)
    gate_up = LoRALinear(state, 64, [48, 48], 8, torch.float32, cpu)
    down = LoRALinear(state, 512, [64], 8, torch.float32, cpu)  # K 512: the shrink splits K
    ops = SimpleNamespace(lora_add=tk.lora_add)
    state.h_workspace = torch.full((32, 16 + 8), 7.0)  # stale values: zeroed by gate_up
    gate_up.h_cols, down.h_cols, gate_up.zeroes_h = slice(0, 16), slice(16, 24), True
    for lora in (gate_up, down):
        lora.ops = ops
        lora.a.normal_(0, 0.2)
        lora.b.normal_(0, 0.2)
    for slots in ([1], [0, -1, 1] * 7):
        meta = meta_views(torch.from_numpy(pack_meta(np.array(slots), 2)), len(slots), 2)
        state.set_eager(meta)
        for lora, k, n in ((gate_up, 64, 96), (down, 512, 64)):  # forward order
            x, y = torch.randn(len(slots), k), torch.randn(len(slots), n)
            want = reference.lora_add(x, y.clone(), lora.a, lora.b, meta, lora.shard_starts)
            torch.testing.assert_close(lora.add_to(x, y.clone()), want, atol=1e-4, rtol=1e-4)
        state.h_workspace[: len(slots)].fill_(7.0)  # the next forward finds stale values again
