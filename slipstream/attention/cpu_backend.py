"""CPU attention backend: the reference backend's contract (rotate q and k, write K/V to the
paged cache, attend) with the work every layer of a step shares done once per step.

The reference twins redo per layer what depends only on the step: the cos/sin rows of the
step's positions, and the rows whose slot is real (a boolean index, so a nonzero() per layer).
Here both are built once and kept on the step's AttentionMetadata (a fresh object each step,
like the attention plan in kernels/cpu.py); q and k, adjacent columns of one QKV product, are
rotated in one pass; K and V go to the cache with index_copy_. The rotation is
x * [cos, cos] + [x2, x1] * [-sin, sin], the reference's products and sums in the same order,
so the results are bit-identical (tests/attention/test_cpu_backend.py). Quantized caches and
partial rotary dimensions take the reference path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from slipstream.attention.backend import AttentionMetadata
from slipstream.attention.reference import ReferenceAttentionBackend, attention_options

_STEP_ATTR = "_cpu_rotary_step"


@dataclass
class _StepInputs:
    """What every layer of one step shares: its positions' cos/sin and the K/V write slots."""

    positions: torch.Tensor  # the step's positions: a layer given other ones rebuilds
    slots: torch.Tensor  # [rows written] int64 flat cache slots
    rows: torch.Tensor | None  # the token rows written (slot >= 0); None: all of them
    tables: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict
    )  # id(cos_sin_cache) -> (that cache, [cos, cos], [-sin, sin])

    def cos_sin(self, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D] float32 factors of the rotation for this step's positions."""
        entry = self.tables.get(id(cos_sin_cache))
        if entry is None or entry[0] is not cos_sin_cache:
            half = cos_sin_cache.shape[-1] // 2
            cs = cos_sin_cache.index_select(0, self.positions.long())
            cos, sin = cs[:, :half], cs[:, half:]
            entry = (
                cos_sin_cache,
                torch.cat([cos, cos], dim=-1).unsqueeze(1),
                torch.cat([-sin, sin], dim=-1).unsqueeze(1),
            )
            self.tables[id(cos_sin_cache)] = entry
        return entry[1], entry[2]


def _step_inputs(meta: AttentionMetadata, positions: torch.Tensor) -> _StepInputs:
    step = meta.__dict__.get(_STEP_ATTR)
    if step is None or step.positions is not positions:
        slot_mapping = meta.slot_mapping
        valid = slot_mapping >= 0
        if bool(valid.all()):
            step = _StepInputs(positions, slot_mapping.long(), None)
        else:
            rows = valid.nonzero().squeeze(1)
            step = _StepInputs(positions, slot_mapping.index_select(0, rows).long(), rows)
        meta.__dict__[_STEP_ATTR] = step
    return step


def _joint_qk(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q [T, Hq, D] and k [T, Hkv, D] as one [T, Hq + Hkv, D] view when k's heads follow q's in
    memory (both slices of one QKV product), else None."""
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or q.stride() != k.stride() or q.stride()[1:] != (d, 1):
        return None
    if k.data_ptr() != q.data_ptr() + hq * d * q.element_size():
        return None
    return q.as_strided((t, hq + k.shape[1], d), q.stride())


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """reference.apply_rotary's result: [x1*cos - x2*sin, x2*cos + x1*sin] in float32."""
    xf = x.float()
    return (xf * cos + xf.roll(x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)


class CpuAttentionBackend(ReferenceAttentionBackend):
    """forward(q [T,Hq,D], k/v [T,Hkv,D], ...) -> [T, Hq, D], as ReferenceAttentionBackend."""

    name = "cpu"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        l2_prefetch: torch.Tensor | None = None,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        if k_cache.element_size() == 1 or cos_sin_cache.shape[-1] != q.shape[-1] or q.shape[0] == 0:
            return super().forward(
                q,
                k,
                v,
                positions,
                cos_sin_cache,
                k_cache,
                v_cache,
                meta,
                scale,
                k_scale=k_scale,
                v_scale=v_scale,
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )
        step = _step_inputs(meta, positions)
        cos, sin = step.cos_sin(cos_sin_cache)
        joint = _joint_qk(q, k)
        if joint is not None:
            qk = _rotate(joint, cos, sin)
            q_rot, k_rot = qk[:, : q.shape[1]], qk[:, q.shape[1] :]
        else:
            q_rot, k_rot = _rotate(q, cos, sin), _rotate(k, cos, sin)
        _write(k_rot, k_cache, step)
        _write(v, v_cache, step)
        return self.ops.paged_attention(
            q_rot, k_cache, v_cache, meta, scale, **attention_options(sliding_window, logit_softcap)
        )


def _write(x: torch.Tensor, cache: torch.Tensor, step: _StepInputs) -> None:
    """Rows of x ([T, Hkv, D]) into their flat cache slots (the slot -1 rows skipped)."""
    if step.rows is not None:
        x = x.index_select(0, step.rows)
    flat = cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
    flat.index_copy_(0, step.slots, x.to(cache.dtype))
