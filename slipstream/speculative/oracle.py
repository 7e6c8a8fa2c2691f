"""Test-only proposer for measuring the cost of speculation apart from any draft's quality.

Given the target's own greedy continuation of each prompt (recorded by a run without
speculation, `set_reference_outputs`), each draft token is the target's next token with
probability `acceptance_rate` and a wrong token otherwise, so the acceptance rate is set rather
than learned. A request whose prompt has no recorded continuation gets no drafts.
"""

from __future__ import annotations

import random

from slipstream.engine.request import Request

_REFERENCE: dict[tuple[int, ...], list[int]] = {}


def set_reference_outputs(outputs: dict[tuple[int, ...], list[int]], replace: bool = True) -> None:
    """The target's continuation per prompt (token ids), replacing any set before unless
    replace=False."""
    if replace:
        _REFERENCE.clear()
    _REFERENCE.update({tuple(k): list(v) for k, v in outputs.items()})


class OracleProposer:
    method = "oracle"

    def __init__(
        self,
        acceptance_rate: float,
        vocab_size: int,
        seed: int = 0,
        tree_paths: list[tuple[int, ...]] | None = None,
    ):
        self.acceptance_rate = acceptance_rate
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)
        self.tree_paths = tree_paths

    def propose(self, wanted: list[tuple[Request, int]]) -> dict:
        drafts = {}
        for request, k in wanted:
            ref = _REFERENCE.get(tuple(request.prompt_token_ids))
            if ref is None:
                continue
            m = request.num_output_tokens
            nexts = ref[m : m + k]
            if self.tree_paths is not None:
                drafts[request.request_id] = self._tree(nexts)
                continue
            drafts[request.request_id] = [
                t if self._rng.random() < self.acceptance_rate else (t + 1) % self.vocab_size for t in nexts
            ]
        return drafts

    def _tree(self, nexts: list[int]) -> tuple[list[int], list[int]]:
        """A tree (speculative_token_tree) whose right branch at each level is a random rank
        (present with probability acceptance_rate), every other node a wrong token."""
        from slipstream.speculative.tree import parents_of

        paths = [p for p in self.tree_paths if len(p) <= len(nexts)]
        width = max((r for p in paths for r in p), default=0) + 1
        right = [
            self._rng.randrange(width) if self._rng.random() < self.acceptance_rate else -1 for _ in nexts
        ]
        tokens = []
        for p in paths:
            d = len(p) - 1
            on_path = all(r == right[i] for i, r in enumerate(p))
            tokens.append(nexts[d] if on_path else (nexts[d] + 1 + p[-1]) % self.vocab_size)
        return tokens, parents_of(paths)

    def forget(self, request_ids) -> None:
        pass
