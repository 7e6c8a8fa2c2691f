"""The batch's token bitmask: filled on the host by each constrained row's matcher, copied to
the device once, and applied to the logits there (disallowed tokens become -inf).

Bit j of word w of a row allows token 32 * w + j. The mask has a row per logits row; only the
constrained rows are filled and applied. `apply_bitmask_reference` is the plain PyTorch twin
of xgrammar's kernels, the test oracle and the fallback where they cannot load.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from slipstream.runner.cpu_threads import physical_cores

if TYPE_CHECKING:
    from slipstream.engine.request import Request

logger = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


# From this many constrained rows on, xgrammar fills the rows in parallel C++ threads.
BATCH_FILL_ROWS = 8


class BitmaskFiller:
    """Fills the batch's bitmask into one preallocated host buffer (pinned on CUDA) and copies
    it into one preallocated device buffer, so a step allocates nothing and never syncs: the
    copy is queued on the stream, behind the forward it runs beside."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._device: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None  # recorded after the last copy from _host
        self._batch = None

    def fill(
        self,
        requests: list[Request],
        rows: list[int],
        vocab_size: int,
        device: torch.device,
        drafts: dict[int, list[int]] | None = None,
    ) -> torch.Tensor:
        """int32 [max(rows) + 1, words] on `device`: row i is requests[i]'s next-token mask
        for i in `rows` (other rows hold stale words: never applied). drafts: per first row
        of a verification, its draft tokens; its rows follow the matcher along them."""
        num_rows = rows[-1] + 1
        host = self._host_rows(num_rows, bitmask_words(vocab_size), device)
        if drafts:
            along = {r + j for r, d in drafts.items() for j in range(len(d) + 1)}
            for r, d in drafts.items():
                requests[r].grammar.fill_bitmask_along(host, r, d)
            rows = [i for i in rows if i not in along]
        if len(rows) >= BATCH_FILL_ROWS:
            self._batch_matcher().batch_fill_next_token_bitmask(
                [requests[i].grammar.matcher for i in rows], host, indices=rows
            )
        else:
            for i in rows:
                requests[i].grammar.fill_bitmask(host, i)
        if device.type == "cpu":
            return host
        on_device = self._device[:num_rows]
        on_device.copy_(host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        return on_device

    def _batch_matcher(self):
        if self._batch is None:
            import xgrammar as xgr

            # xgrammar's "auto" is half of every CPU of the host, which a container may not own.
            self._batch = xgr.BatchGrammarMatcher(max_threads=max(1, min(8, physical_cores() // 2)))
        return self._batch

    def _host_rows(self, num_rows: int, words: int, device: torch.device) -> torch.Tensor:
        """The first num_rows rows of the host buffer (contiguous, as xgrammar wants), once
        the previous step's copy out of it has finished (it has, unless the host runs a
        whole step ahead)."""
        if self._copied is not None:
            self._copied.synchronize()
        buf = self._host
        if buf is None or buf.shape[0] < num_rows or buf.shape[1] != words:
            size = max(num_rows, 2 * (buf.shape[0] if buf is not None else 0), 8)
            cuda = device.type == "cuda"
            buf = self._host = torch.empty(size, words, dtype=torch.int32, pin_memory=cuda)
            if device.type != "cpu":
                self._device = torch.empty(size, words, dtype=torch.int32, device=device)
            self._copied = torch.cuda.Event() if cuda else None
        return buf[:num_rows]


_KERNEL_OK: dict[str, bool] = {}  # device type -> False once xgrammar's kernel failed there


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set logits[i, t] to -inf where bit t of bitmask[i] is 0, for i in rows. In place, in one
    kernel: xgrammar's (Triton on CUDA, C++ on a CPU); where it cannot load (a missing
    dependency, no compiler for its first-use build) the reference runs instead."""
    kind = logits.device.type
    if kind in ("cuda", "cpu") and _KERNEL_OK.get(kind, True):
        try:
            _apply_xgrammar(logits, bitmask, rows)
            return
        except (ImportError, RuntimeError, OSError) as exc:
            _KERNEL_OK[kind] = False
            logger.warning(
                "xgrammar's %s bitmask kernel is unavailable (%s); applying the bitmask with torch ops",
                kind,
                exc,
            )
    apply_bitmask_reference(logits, bitmask, rows)


def _apply_xgrammar(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    import xgrammar as xgr

    if len(rows) == logits.shape[0]:
        indices = None  # every row: nothing to index
    elif logits.is_cuda:  # queued behind the forward, like the mask (never a blocking copy)
        indices = torch.tensor(rows, dtype=torch.int32, pin_memory=True).to(logits.device, non_blocking=True)
    else:
        indices = rows
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=indices)


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    vocab = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    bits = (bitmask[index.to(bitmask.device)].unsqueeze(-1) >> shifts) & 1  # [R, words, 32]
    allowed = bits.flatten(1)[:, :vocab].bool()
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
