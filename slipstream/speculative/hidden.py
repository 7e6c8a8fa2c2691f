"""The target's hidden states of one step, for proposers that draft from them (Medusa, EAGLE).

The runner fills a StepHidden after a step when the proposer asks for hidden states
(`needs_hidden`); the decoder hands it to the proposer (`observe`). The tensors stay on the
device: a proposer reads only the rows of tokens the step made known (the fed tokens of a
prefill chunk or decode, the root and accepted drafts of a verification).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.scheduler.output import ScheduledSeq


@dataclass
class StepHidden:
    # [T, H]: the final (normed) hidden state of every fed token, in the step's flat order.
    hidden: torch.Tensor
    # [T, n * H] or None: EAGLE-3's auxiliary layers' hidden states, concatenated.
    aux_hidden: torch.Tensor | None
    seqs: list[ScheduledSeq]
    query_start_loc: list[int]
    # Per request id: the step's flat rows whose tokens are now known, in sequence order.
    known_rows: dict[str, list[int]]

    def num_tokens_after(self, seq: ScheduledSeq) -> int:
        """The request's token count once this step's sampled token is appended."""
        return seq.start_pos + len(self.known_rows[seq.request_id]) + 1


def known_rows(
    seqs: list[ScheduledSeq],
    query_start_loc: list[int],
    sampled: dict[str, list[int]],
    paths: dict[str, list[int]],
) -> dict[str, list[int]]:
    """Rows of each seq whose tokens the step made known: every fed token, except a
    verification's rejected drafts (a chain keeps its first len(sampled) rows, a tree its root
    and accepted path)."""
    rows = {}
    for i, seq in enumerate(seqs):
        lo, hi = query_start_loc[i], query_start_loc[i + 1]
        if not seq.num_spec_tokens:
            rows[seq.request_id] = list(range(lo, hi))
            continue
        root = hi - seq.num_spec_tokens - 1
        if seq.spec_parents:
            path = paths.get(seq.request_id, [])
            rows[seq.request_id] = list(range(lo, root + 1)) + [root + 1 + p for p in path]
        else:
            n = len(sampled.get(seq.request_id) or [None])
            rows[seq.request_id] = list(range(lo, root + n))
    return rows
