"""This process's place in a tensor x pipeline parallel layout, and its process groups.

Global rank = pp_rank * tp_size + tp_rank: the ranks of one pipeline stage are consecutive, so a
stage's tensor-parallel group sits on neighbouring GPUs (NVLink) and stages talk rank to rank.
A single-process engine never initialises anything here: `rank_info()` is then tp = pp = 1 and
every helper below is a no-op that the model code does not even call.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankInfo:
    """Where this rank sits: its tensor-parallel and pipeline coordinates."""

    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @staticmethod
    def of(rank: int, tp_size: int, pp_size: int) -> RankInfo:
        return RankInfo(tp_size, rank % tp_size, pp_size, rank // tp_size)


def output_rank(tp_size: int, pp_size: int) -> int:
    """The rank that samples and returns tokens: tensor rank 0 of the last stage."""
    return (pp_size - 1) * tp_size


class _Groups:
    """The live layout: this rank's coordinates and its tensor-parallel group."""

    info = RankInfo()
    tp_group: dist.ProcessGroup | None = None
    tp_ranks: list[int] = [0]


def rank_info() -> RankInfo:
    return _Groups.info


def init_world(rank: int, world_size: int, init_method: str, backend: str,
               timeout_s: float) -> None:
    """Join the default process group (every worker of the pool, once per process)."""
    if dist.is_initialized():
        return
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def set_layout(tp_size: int, pp_size: int) -> RankInfo | None:
    """Make the tensor-parallel groups of a tp x pp layout on ranks 0 .. tp*pp-1 of the world.

    Collective over the whole world (every worker calls it in the same order, even those the
    layout leaves idle, which get None). A single-rank world needs no group at all."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if tp_size * pp_size > world:
        raise ValueError(f"tensor_parallel_size {tp_size} x pipeline_parallel_size {pp_size} "
                         f"needs {tp_size * pp_size} ranks; the pool has {world}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = None
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = dist.new_group(ranks) if world > 1 else None
        if rank in ranks:
            mine = (group, ranks)
    if mine is None:
        _Groups.info, _Groups.tp_group, _Groups.tp_ranks = RankInfo(), None, [0]
        return None
    _Groups.info = RankInfo.of(rank, tp_size, pp_size)
    _Groups.tp_group, _Groups.tp_ranks = mine
    return _Groups.info


def reset_layout() -> None:
    _Groups.info, _Groups.tp_group, _Groups.tp_ranks = RankInfo(), None, [0]


# ---- collectives the model calls (only when its tp_size / pp_size > 1) -------------------


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the tensor-parallel group, in place."""
    dist.all_reduce(x, group=_Groups.tp_group)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on each rank -> [..., tp * n], rank order. An all-gather rather than a gather
    to rank 0: every rank then runs the same kernels, which a captured CUDA graph needs."""
    parts = [torch.empty_like(x) for _ in _Groups.tp_ranks]
    dist.all_gather(parts, x.contiguous(), group=_Groups.tp_group)
    return torch.cat(parts, dim=-1)


def tp_broadcast_first(x: torch.Tensor) -> torch.Tensor:
    """x as the tensor-parallel group's first rank holds it, on every rank, in place."""
    dist.broadcast(x, src=_Groups.tp_ranks[0], group=_Groups.tp_group)
    return x


def pp_send(tensors: list[torch.Tensor]) -> None:
    """Send a stage's activations to the same tensor rank of the next stage."""
    dst = _Groups.info.rank + _Groups.info.tp_size
    for t in tensors:
        dist.send(t.contiguous(), dst)


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device
            ) -> list[torch.Tensor]:
    """Receive what the previous stage's pp_send sent (shapes known from the batch)."""
    src = _Groups.info.rank - _Groups.info.tp_size
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src)
        out.append(t)
    return out
