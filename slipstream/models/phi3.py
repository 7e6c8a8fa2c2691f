"""Phi-3: the Llama network with q/k/v and gate/up already fused in the checkpoint
(`qkv_proj`, `gate_up_proj` load whole into the fused layers; under tensor parallelism each
rank cuts the fused tensor into its shards and takes its rows of each: layers/linear.py) and
LongRoPE scaling and partial rotary (Phi-4-mini's partial_rotary_factor: layers/rotary.py).
Phi-3's sliding window, where configured, is every layer's."""

from __future__ import annotations

from slipstream.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # The checkpoint's tensors already are the fused ones: nothing to assemble.
    packed_modules_mapping: dict[str, list[str]] = {}
