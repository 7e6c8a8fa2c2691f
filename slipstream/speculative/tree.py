"""Draft trees: shapes, the attention mask of their verification chunk, the accepted path, and
moving the accepted path's K/V into place.

A tree's verification chunk is the request's last known token (the root, chunk index 0) and
its N draft nodes (chunk indices 1..N) in breadth-first order: `parents[i]` is the draft index
of node i's parent, -1 for the root. Breadth-first order makes every prefix of the nodes a tree
again and puts parents before children, so a draft list can be cut like a chain.

Node i sits at position base + depth(i) (its RoPE position) but is stored at slot base + 1 + i
(the chunk order). It attends to the cached prefix and to its ancestors and itself only: the
mask of a chunk row is a bit set over chunk indices (bit j: row may see chunk token j), at most
64 chunk tokens. After verification the K/V of the accepted nodes, computed at their true
positions, is copied to slots base + 1, base + 2, ..., so the cache holds exactly the accepted
tokens, as after a chain.
"""

from __future__ import annotations

import heapq

import torch

MAX_TREE_TOKENS = 64  # chunk tokens (root + nodes): one int64 bit set a row


def depths(parents: list[int]) -> list[int]:
    """Depth of each node (1 for children of the root)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def check_parents(parents: list[int]) -> None:
    """ValueError unless parents describe a breadth-first tree of at most 63 nodes."""
    if len(parents) + 1 > MAX_TREE_TOKENS:
        raise ValueError(f"a draft tree has at most {MAX_TREE_TOKENS - 1} nodes, got {len(parents)}")
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"draft tree node {i}: parent {p} must come before it")
    d = depths(parents)
    if any(b < a for a, b in zip(d, d[1:])):
        raise ValueError("draft tree nodes must be in breadth-first order (depths non-decreasing)")


def row_masks(parents: list[int]) -> list[int]:
    """Per chunk row (root first), the int64 bit set of chunk tokens it attends to."""
    masks = [1]
    for i, p in enumerate(parents):
        masks.append(masks[p + 1] | (1 << (i + 1)))
    return [m - (1 << 64) if m >= 1 << 63 else m for m in masks]  # as signed int64


def tree_from_choices(choices: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Medusa-style choices (paths of top-k ranks, e.g. (0,), (0, 1)) sorted breadth-first;
    ValueError when a path's prefix is missing."""
    paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
    known = set(paths)
    for c in paths:
        if not c or min(c) < 0:
            raise ValueError(f"speculative_token_tree: bad path {c!r}")
        if len(c) > 1 and c[:-1] not in known:
            raise ValueError(f"speculative_token_tree: path {c!r} has no parent {c[:-1]!r}")
    if len(paths) + 1 > MAX_TREE_TOKENS:
        raise ValueError(f"speculative_token_tree: at most {MAX_TREE_TOKENS - 1} nodes")
    return paths


def leaves_on_top_chain(choices) -> list[tuple[int, ...]] | None:
    """Choices for a proposer that expands only its top-1 chain (EAGLE): every path is
    (0, ..., 0, r), the r-th ranked token at its depth as a leaf; sorted breadth-first.
    ValueError otherwise; None for None (no tree)."""
    if choices is None:
        return None
    paths = tree_from_choices(choices)
    for p in paths:
        if any(p[:-1]):
            raise ValueError(
                f"speculative_token_tree: path {list(p)!r}: an EAGLE head expands only its top-1 "
                "chain, so every path is [0, ..., 0, r] (the r-th ranked token at its depth)"
            )
    return paths


def medusa_default_nodes(depth: int) -> int:
    """Nodes in Medusa's default tree of `depth` levels (medusa.py): 5 a level, within the cap."""
    return min(MAX_TREE_TOKENS - 1, 5 * depth)


def default_tree(depth: int, num_nodes: int, width: int = 4) -> list[tuple[int, ...]]:
    """The num_nodes most likely paths of at most `depth` ranks (< width each) if each rank r
    were right with probability about 1 / (r + 2): ranks of the same depth compete, the
    top-1 chain comes first. Breadth-first order."""
    score = lambda path: sum(-_log_weight(r) for r in path)  # noqa: E731
    heap = [(score((r,)), 1, (r,)) for r in range(width)]
    heapq.heapify(heap)
    chosen = []
    while heap and len(chosen) < num_nodes:
        _, _, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < depth:
            for r in range(width):
                child = path + (r,)
                heapq.heappush(heap, (score(child), len(child), child))
    return tree_from_choices(chosen)


def _log_weight(rank: int) -> float:
    import math

    return math.log(1.0 / (rank + 2))


def parents_of(paths: list[tuple[int, ...]]) -> list[int]:
    """Parent index of each path (breadth-first, -1 for depth 1)."""
    index = {p: i for i, p in enumerate(paths)}
    return [-1 if len(p) == 1 else index[p[:-1]] for p in paths]


def prune(parents: list[int], max_depth: int) -> int:
    """How many leading nodes (breadth-first) have depth <= max_depth."""
    n = 0
    for d in depths(parents):
        if d > max_depth:
            break
        n += 1
    return n


def accept_path(drafts: list[int], parents: list[int], sampled: list[int]) -> list[int]:
    """Draft indices of the accepted path: from the root, follow the child whose token equals
    the token sampled at the current row (row 0: the root, row i + 1: node i)."""
    children: dict[int, dict[int, int]] = {}
    for i, (tok, p) in enumerate(zip(drafts, parents)):
        children.setdefault(p, {}).setdefault(tok, i)  # the first of equal siblings
    path, cur = [], -1
    while True:
        nxt = children.get(cur, {}).get(sampled[cur + 1])
        if nxt is None:
            return path
        path.append(nxt)
        cur = nxt


def move_accepted_kv(kv_caches, moves: list[tuple[list[int], list[int]]]) -> None:
    """Copy each layer's K/V of accepted tree nodes to their chain slots. moves: per request
    (source slots, destination slots); sources are read before any destination is written."""
    src = [s for m in moves for s in m[0]]
    if not src:
        return
    dst = [d for m in moves for d in m[1]]
    device = kv_caches[0][0].device
    src_t = torch.tensor(src, dtype=torch.long, device=device)
    dst_t = torch.tensor(dst, dtype=torch.long, device=device)
    for caches in kv_caches:
        for cache in caches:
            flat = cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
            flat.index_copy_(0, dst_t, flat.index_select(0, src_t))


def path_moves(
    path: list[int], start_pos: int, block_ids: list[int], block_size: int
) -> tuple[list[int], list[int]]:
    """(source, destination) slots of the nodes of `path` not already in place: node i is
    stored at chunk index i + 1, its chain place is the path's j + 1."""

    def slot(pos: int) -> int:
        return block_ids[pos // block_size] * block_size + pos % block_size

    src, dst = [], []
    for j, node in enumerate(path):
        if node != j:
            src.append(slot(start_pos + 1 + node))
            dst.append(slot(start_pos + 1 + j))
    return src, dst


def first_chain(tokens: list[int], parents: list[int]) -> list[int]:
    """The tree's leading chain (each depth's first child of the node before): its tokens."""
    chain, cur = [], -1
    for i, p in enumerate(parents):
        if p == cur:
            chain.append(tokens[i])
            cur = i
    return chain
