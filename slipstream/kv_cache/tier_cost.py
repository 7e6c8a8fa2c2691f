"""TierCost: is copying KV blocks between the host tier and the device cheaper than
recomputing them?

Plain numbers, no tensors: the runner measures the copy bandwidth and the matmul rate of this
device at start-up (runner/host_copies.py), the model's shape gives the work per token. A run
of `n` blocks costs `n * block_bytes / copy_bytes_per_s` to copy, and to recompute the
prefill FLOPs of its tokens over `flops_per_s`: the linear layers' `2 * params` a token plus
attention's `4 * layers * heads * head_dim` a token per position it attends to. Later blocks
attend to more positions, so the longer the prefix before a run, the more a copy pays.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TierCost:
    block_size: int
    block_bytes: int  # K and V of one block, every layer
    copy_bytes_per_s: float  # host <-> device, measured (the slower direction)
    flops_per_s: float  # dense matmul rate in the model's dtype, measured
    linear_flops_per_token: float  # 2 * the decoder layers' linear parameters
    attention_flops_per_position: float  # 4 * layers * heads * head_dim

    def __post_init__(self) -> None:
        if self.copy_bytes_per_s <= 0 or self.flops_per_s <= 0:
            raise ValueError("TierCost: the measured rates must be positive")

    def copy_seconds(self, num_blocks: int) -> float:
        return num_blocks * self.block_bytes / self.copy_bytes_per_s

    def recompute_seconds(self, num_blocks: int, start: int) -> float:
        """The prefill of num_blocks blocks whose first token sits at position `start`."""
        tokens = num_blocks * self.block_size
        attended = tokens * start + tokens * (tokens + 1) // 2  # positions each token sees
        flops = tokens * self.linear_flops_per_token + attended * self.attention_flops_per_position
        return flops / self.flops_per_s

    def restore_pays(self, num_blocks: int, start: int) -> bool:
        """Copy back a prefix hit of num_blocks host blocks from position `start`, rather than
        recompute it? All or nothing is right: each later block costs more to recompute and
        the same to copy, so if any block of the run pays, the last ones do."""
        return num_blocks > 0 and self.copy_seconds(num_blocks) < self.recompute_seconds(num_blocks, start)

    def swap_pays(self, num_tokens: int) -> bool:
        """Swap a preempted request of num_tokens computed tokens out and back in, rather than
        recompute them on resume?"""
        num_blocks = num_tokens // self.block_size
        return num_blocks > 0 and 2 * self.copy_seconds(num_blocks) < self.recompute_seconds(num_blocks, 0)

    def ever_pays(self, max_seq_len: int) -> bool:
        """Could a copy ever pay on this engine: the block that is dearest to recompute, the
        last of the longest sequence? If not, nothing is worth offloading at all."""
        return self.restore_pays(1, max(0, max_seq_len - self.block_size))
