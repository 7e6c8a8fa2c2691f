"""Sampled token ids of a launched step, read back without waiting for later work.

Reading a CUDA tensor (`.tolist()`) synchronises its whole stream. The engine launches the next
step before it reads the one in flight (async scheduling, pipelined multi-step decode), so a
plain read would also wait for that next step, and the GPU would then idle while the host
applied the tokens and launched the step after it: one host turnaround per read. Here the
copy to pinned host memory
is queued right behind the kernels that wrote the tokens, with an event after it; reading waits
for that event only.
"""
from __future__ import annotations

import torch


class LaunchedTokens:
    """Token ids on the device (`on_device`, e.g. to feed the next step) and their queued host
    copy (`host()` waits for it). Create it right after the kernels that write the tokens,
    before anything else is queued on the stream."""

    def __init__(self, tokens: torch.Tensor):
        self.on_device = tokens
        self._ready: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(tokens.device))  # the copy's stream
        else:
            self._host = tokens

    def host(self) -> torch.Tensor:
        """The token ids on the host (waits for the copy, not for later GPU work)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host
