"""Lookahead proposer: Jacobi iteration with an n-gram pool, no extra model.

Per request it keeps:
- a Jacobi window: guesses for the next W positions after the last known token. Verification
  samples every row of the tree, including rows past the first mismatch; the samples at the
  window chain's rows are the target's predictions one position further, given the previous
  guesses: one Jacobi update of the window. After a step the window is those samples, shifted
  past the tokens the step emitted (old guesses fill positions the chain did not reach).
- an n-gram pool: n-grams of length N, keyed by their first token, most recent first, bounded.
  They come from the request's own prompt and output and from the trajectories of the
  verification rows (the last N - 1 tokens of a node's branch followed by the token the
  target sampled at its row).

Each step drafts a small tree (speculative/tree.py): up to G branches (what followed the
latest earlier match of the text's longest suffix of up to N - 1 tokens, then the pool's
continuations of the last known token, each extended by chaining pool n-grams), then the
window as one more chain, merged where they share a prefix. Verification accepts the longest
matching branch as for any tree, so greedy output is exact and sampling keeps the target
distribution (the drafts are deterministic: docs/speculative.md, Exactness).
"""

from __future__ import annotations

from collections import OrderedDict

from slipstream.engine.request import Request
from slipstream.scheduler.output import RunnerOutput, SchedulerOutput
from slipstream.speculative.ngram import lookup
from slipstream.speculative.tree import MAX_TREE_TOKENS

# First tokens the pool keeps per request (least recently refreshed dropped first), and the
# prompt's last tokens scanned for n-grams when a request is first seen.
MAX_POOL_KEYS = 1024
PROMPT_SCAN_TOKENS = 4096


class NgramPool:
    """N-grams keyed by their first token; per key up to `per_key` continuations (the n-gram
    without its first token), most recent first; at most `max_keys` keys."""

    def __init__(self, n: int, per_key: int, max_keys: int = MAX_POOL_KEYS):
        self.n, self.per_key, self.max_keys = n, per_key, max_keys
        self._pool: OrderedDict[int, list[tuple[int, ...]]] = OrderedDict()

    def add(self, ngram) -> None:
        """Add one n-gram (length n) as the most recent of its key."""
        first, rest = ngram[0], tuple(ngram[1:])
        conts = self._pool.pop(first, [])
        if rest in conts:
            conts.remove(rest)
        conts.insert(0, rest)
        del conts[self.per_key :]
        self._pool[first] = conts
        while len(self._pool) > self.max_keys:
            self._pool.popitem(last=False)

    def add_all(self, tokens: list[int]) -> None:
        """Add every n-gram of `tokens`, in order (the last the most recent)."""
        for end in range(self.n, len(tokens) + 1):
            self.add(tokens[end - self.n : end])

    def continuations(self, first: int) -> list[tuple[int, ...]]:
        return list(self._pool.get(first, ()))

    def __len__(self) -> int:
        return len(self._pool)


class _State:
    """One request's pool, window and what its last proposal drafted."""

    def __init__(self, n: int, per_key: int):
        self.pool = NgramPool(n, per_key)
        self.scanned = 0  # tokens whose n-grams are in the pool
        self.window: list[int] = []
        self.window_start = -1  # position of window[0]
        self.chain: list[int] = []  # the window chain of the last proposal


class LookaheadProposer:
    method = "lookahead"

    def __init__(self, window: int, ngram: int, candidates: int):
        self.window, self.ngram, self.candidates = window, ngram, candidates
        self._states: dict[str, _State] = {}

    # ---- proposing -----------------------------------------------------------------------
    def propose(self, wanted: list[tuple[Request, int]]) -> dict[str, tuple[list[int], list[int]]]:
        """Per request id a tree (tokens, parents) of depth <= its k."""
        drafts = {}
        for request, k in wanted:
            state = self._state(request)
            tokens = request.all_token_ids
            self._scan(state, tokens)
            branches = self._pool_branches(state, tokens, k)
            state.chain = self._window_chain(state, tokens, k)
            tree_tokens, parents = merge_chains([b for b in branches if b] + [state.chain])
            if tree_tokens:
                drafts[request.request_id] = (tree_tokens, parents)
        return drafts

    def _pool_branches(self, state: _State, tokens: list[int], k: int) -> list[list[int]]:
        """Up to G branches: what followed the latest earlier match of the longest suffix (up
        to N - 1 tokens) of the request's text, then the pool's continuations of the last
        token, most recent first; each extended to k tokens by the most recent continuation
        of its last token."""
        found = lookup(tokens, 1, self.ngram - 1, k)
        branches = [found] if found else []
        for cont in state.pool.continuations(tokens[-1]):
            if len(branches) == self.candidates:
                break
            branch = list(cont[:k])
            while len(branch) < k:
                nxt = state.pool.continuations(branch[-1])
                if not nxt:
                    break
                branch += nxt[0][: k - len(branch)]
            if branch not in branches:
                branches.append(branch)
        return branches

    def _state(self, request: Request) -> _State:
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = _State(self.ngram, self.candidates)
        return state

    def _scan(self, state: _State, tokens: list[int]) -> None:
        """Add the n-grams of tokens not scanned yet (a new request: its prompt's last part)."""
        start = max(state.scanned - self.ngram + 1, len(tokens) - PROMPT_SCAN_TOKENS, 0)
        state.pool.add_all(tokens[start:])
        state.scanned = len(tokens)

    def _window_chain(self, state: _State, tokens: list[int], k: int) -> list[int]:
        """The window's guesses for the next positions (shifted to start right after the last
        known token), padded to min(W, k) by repeating its last guess."""
        length = len(tokens)
        if state.window_start < 0:  # first proposal: what followed the last token before
            state.window, state.window_start = lookup(tokens, 1, 1, self.window), length
        state.window = state.window[length - state.window_start :][: self.window]
        state.window_start = length
        size = min(self.window, k)
        chain = state.window[:size]
        pad = chain[-1] if chain else tokens[-1]
        return chain + [pad] * (size - len(chain))

    # ---- learning from verification ------------------------------------------------------
    def observe_verification(self, sched_out: SchedulerOutput, runner_out: RunnerOutput) -> None:
        """Update windows and pools from every row the target sampled in a verification."""
        for seq in sched_out.seqs:
            state = self._states.get(seq.request_id)
            rows = runner_out.spec_row_token_ids.get(seq.request_id)
            if state is None or not seq.num_spec_tokens or not rows:
                continue
            m = seq.num_spec_tokens
            drafts = seq.token_ids[-m:]
            parents = seq.spec_parents or list(range(-1, m - 1))
            base = seq.start_pos + seq.num_tokens - m  # position of the first draft
            context = seq.request.token_ids_slice(max(0, base - self.ngram), base)
            self._collect_trajectories(state, context, drafts, parents, rows)
            self._jacobi_update(state, base, drafts, parents, rows)

    def _collect_trajectories(self, state, context, drafts, parents, rows) -> None:
        """Per node, the last N - 1 tokens of its branch and the token sampled at its row."""
        branch: list[list[int]] = []
        for i, (tok, p) in enumerate(zip(drafts, parents)):
            branch.append((context if p < 0 else branch[p]) + [tok])
            gram = branch[i][-(self.ngram - 1) :] + [rows[i + 1]]
            if len(gram) == self.ngram:
                state.pool.add(gram)

    def _jacobi_update(self, state, base, drafts, parents, rows) -> None:
        """The window chain's row samples replace the guesses of the positions after them."""
        if state.window_start != base:
            return
        node, guesses = -1, dict(enumerate(state.window))  # offset from base -> guess
        for depth, tok in enumerate(state.chain):
            node = _child(drafts, parents, node, tok)
            if node is None:
                break
            guesses[depth + 1] = rows[node + 1]  # its row predicts the position after it
        window: list[int] = []
        while len(window) in guesses:
            window.append(guesses[len(window)])
        state.window = window

    def forget(self, request_ids) -> None:
        for rid in request_ids:
            self._states.pop(rid, None)


def _child(drafts: list[int], parents: list[int], node: int, token: int) -> int | None:
    """The first child of `node` (-1: the root) drafting `token`."""
    for i, (t, p) in enumerate(zip(drafts, parents)):
        if p == node and t == token:
            return i
    return None


def merge_chains(chains: list[list[int]]) -> tuple[list[int], list[int]]:
    """A breadth-first tree (tokens, parents) holding every chain as a branch from the root,
    shared prefixes merged; within a depth, nodes keep the order of the chains that made them
    (the first chain is the tree's first chain)."""
    index: dict[tuple[int, int], int] = {}
    nodes: list[tuple[int, int, int]] = []  # (depth, token, parent's insertion index)
    for chain in chains:
        parent = -1
        for depth, tok in enumerate(chain):
            key = (parent, tok)
            if key not in index:
                index[key] = len(nodes)
                nodes.append((depth, tok, parent))
            parent = index[key]
    order = sorted(range(len(nodes)), key=lambda i: nodes[i][0])  # stable: parents first
    position = {old: new for new, old in enumerate(order)}
    tokens = [nodes[i][1] for i in order]
    parents = [-1 if nodes[i][2] < 0 else position[nodes[i][2]] for i in order]
    assert len(tokens) < MAX_TREE_TOKENS, "config.check bounds (candidates + 1) * k"
    return tokens, parents
