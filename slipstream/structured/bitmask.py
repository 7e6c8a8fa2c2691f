"""The batch's token bitmask: filled on the host by each constrained row's matcher, copied to
the device once, and applied to the logits there (disallowed tokens become -inf).

Bit j of word w of a row allows token 32 * w + j. The mask has a row per logits row; only the
constrained rows are filled and applied. `apply_bitmask_reference` is the plain PyTorch twin
of xgrammar's kernel, used on the CPU and as the test oracle.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from slipstream.engine.request import Request

logger = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


# From this many constrained rows on, xgrammar fills the rows in parallel C++ threads.
BATCH_FILL_ROWS = 8


class BitmaskFiller:
    """Reuses one host buffer (pinned on CUDA) so a step allocates nothing."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._batch = None

    def fill(
        self, requests: list[Request], rows: list[int], vocab_size: int, device: torch.device
    ) -> torch.Tensor:
        """int32 [len(requests), words] on `device`: row i is requests[i]'s next-token mask
        for i in `rows` (other rows are left as they were: never applied)."""
        words = bitmask_words(vocab_size)
        host = self._buffer(len(requests), words, device)
        if len(rows) >= BATCH_FILL_ROWS:
            self._batch_matcher().batch_fill_next_token_bitmask(
                [requests[i].grammar.matcher for i in rows], host, indices=rows)
        else:
            for i in rows:
                requests[i].grammar.fill_bitmask(host, i)
        return host.to(device, non_blocking=True)

    def _batch_matcher(self):
        if self._batch is None:
            import xgrammar as xgr

            self._batch = xgr.BatchGrammarMatcher()
        return self._batch

    def _buffer(self, num_rows: int, words: int, device: torch.device) -> torch.Tensor:
        buf = self._host
        if buf is None or buf.shape[0] < num_rows or buf.shape[1] != words:
            size = max(num_rows, 2 * (buf.shape[0] if buf is not None else 0), 8)
            buf = torch.empty(size, words, dtype=torch.int32, pin_memory=device.type == "cuda")
            self._host = buf
        # A row of a buffer: fill_next_token_bitmask wants a contiguous [R, words] tensor.
        return buf[:num_rows]


_DEVICE_KERNEL_OK = True  # False once xgrammar's CUDA kernel failed to load here


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set logits[i, t] to -inf where bit t of bitmask[i] is 0, for i in rows. In place.
    On CUDA xgrammar's kernel does it; where xgrammar or its kernel cannot load (a missing
    dependency, no compiler for its first-use build) the reference runs on the device instead."""
    global _DEVICE_KERNEL_OK
    if logits.is_cuda and _DEVICE_KERNEL_OK:
        try:
            import xgrammar as xgr

            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1],
                                            indices=rows)
            return
        except (ImportError, RuntimeError, OSError) as exc:
            _DEVICE_KERNEL_OK = False
            logger.warning("xgrammar's CUDA bitmask kernel is unavailable (%s); applying the "
                           "bitmask with torch ops on the device", exc)
    apply_bitmask_reference(logits, bitmask, rows)


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    vocab = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    bits = (bitmask[index.to(bitmask.device)].unsqueeze(-1) >> shifts) & 1  # [R, words, 32]
    allowed = bits.flatten(1)[:, :vocab].bool()
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
