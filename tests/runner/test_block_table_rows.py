"""BlockTableRows: block tables kept across steps give the same arrays as a fresh build, through
random growth, trims, in-place edits (blocks released behind a window), preemptions (a new list),
finishes (rows given back and reused) and width changes."""

from __future__ import annotations

import random

import numpy as np

from slipstream.engine.request import Request
from slipstream.runner.input_batch import BlockTableRows, build_host_batch
from slipstream.sampling_params import SamplingParams
from slipstream.scheduler.output import ScheduledSeq

BLOCK = 4


def _seq(request: Request, blocks: list[int]) -> ScheduledSeq:
    """A decode of the request's last slot its blocks hold room for."""
    start = max(len(blocks) * BLOCK - 1 - random.Random(len(blocks)).randrange(BLOCK), 0)
    return ScheduledSeq(request, [1], start, blocks, True)


def _edit(rng: random.Random, blocks: list[int], next_block: list[int]) -> list[int]:
    """One change of a live block list (in place unless it is replaced)."""
    kind = rng.randrange(6)
    if kind <= 1:  # grows (most steps of a long decode)
        blocks.extend(range(next_block[0], next_block[0] + rng.randint(1, 3)))
        next_block[0] += 3
    elif kind == 2 and len(blocks) > 1:  # trimmed (rejected drafts), then maybe regrown
        del blocks[rng.randrange(1, len(blocks)) :]
    elif kind == 3 and len(blocks) > 2:  # released behind a sliding window (same length)
        k = rng.randrange(1, len(blocks))
        blocks[:k] = [0] * k
    elif kind == 4:  # preempted and readmitted: a new list
        blocks = list(range(next_block[0], next_block[0] + rng.randint(1, 5)))
        next_block[0] += 5
    return blocks


def test_kept_rows_equal_a_fresh_build():
    rng = random.Random(0)
    tables = BlockTableRows(rows=2, width=2)  # small: rows and columns must grow
    live: dict[str, tuple[Request, list[int]]] = {}
    next_block, counter = [1], 0
    for _ in range(400):
        finished = []
        for rid in list(live):
            if rng.random() < 0.08:
                finished.append(rid)
                del live[rid]
        while len(live) < 6 and rng.random() < 0.7:
            counter += 1
            request = Request(f"r{counter}", [1], SamplingParams())
            live[request.request_id] = (request, list(range(next_block[0], next_block[0] + 2)))
            next_block[0] += 2
        for rid, (request, blocks) in list(live.items()):
            if rng.random() < 0.5:
                live[rid] = (request, _edit(rng, blocks, next_block))
        tables.forget(finished)
        chosen = [v for v in live.values() if v[1] and rng.random() < 0.8]
        if not chosen:
            continue
        seqs = [_seq(request, blocks) for request, blocks in chosen]
        width = rng.choice([None, max(len(b) for _, b in chosen) + rng.randrange(3)])
        want = build_host_batch(seqs, BLOCK, width).block_tables
        got = build_host_batch(seqs, BLOCK, width, tables=tables).block_tables
        assert got.dtype == want.dtype and np.array_equal(got, want)
    assert set(tables._row_of) <= set(live)  # finished requests' rows were given back
