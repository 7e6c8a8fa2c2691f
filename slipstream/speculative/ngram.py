"""N-gram (prompt lookup) proposer: the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, trying n from prompt_lookup_max down to prompt_lookup_min. No model:
it pays off where outputs repeat their context (code edits, extraction, summaries)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from slipstream.engine.request import Request


class NgramProposer:
    method = "ngram"

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Per request id, up to `k` draft tokens (none when no n-gram matches)."""
        drafts = {}
        for request, k in wanted:
            found = lookup(request.all_token_ids, self.min_n, self.max_n, k)
            if found:
                drafts[request.request_id] = found
        return drafts

    def forget(self, request_ids) -> None:  # keeps no per-request state
        pass


def lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens after the latest earlier match of the longest suffix of length
    max_n..min_n that occurs earlier in `tokens`; [] when none does."""
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Windows that start before the suffix itself and leave at least one token after them.
        windows = sliding_window_view(arr[: length - 1], n)
        hits = np.flatnonzero((windows == arr[length - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []
