"""How many draft tokens a step verifies, from the batch size and the measured acceptance.

A decode step of B requests reads every weight once whatever B is, until its B tokens reach the
point where the matrix products stop being bound by reading the weights (`ridge_tokens`, about
128 tokens for a bf16 8B model on an H100). Verifying k drafts a request feeds B * (k + 1)
tokens; below the ridge that costs about one decode step, above it the cost grows with the
tokens. With per-token acceptance a, a request emits 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)
tokens a step on average. The engine picks the k in 0..num_speculative_tokens that maximises

    expected tokens(a, k) / (max(1, B * (k + 1) / ridge_tokens) * cost_ratio)

A speculating step also gives up what makes plain decode steps cheap (multi-step decode, async
steps, the decode CUDA graphs), so it costs more than a plain step of the same tokens:
cost_ratio is that factor, measured from the engine's step times (step_cost.py). Until enough
steps are measured it is 1 + SPECULATION_OVERHEAD, from a batch-1 run whose drafts were all
rejected (Llama-3.1-8B shape, bf16, one H100: 0.78x the plain tok/s at k = 4). With good acceptance the engine
speculates fully at batch 1, and at large batches less or not at all; with poor acceptance it
stops, and SpeculativeDecoder probes now and then so that it notices when acceptance recovers.
"""

from __future__ import annotations

SPECULATION_OVERHEAD = 0.28


def expected_tokens(acceptance: float, k: int) -> float:
    """Mean tokens a verification of k drafts emits when each is accepted with `acceptance`."""
    return sum(acceptance**i for i in range(k + 1))


def choose_k(
    batch_size: int, max_k: int, acceptance: float, ridge_tokens: int, cost_ratio: float | None = None
) -> int:
    """The number of drafts per request that maximises expected tokens per unit of step cost.

    cost_ratio: a verifying step's cost over a plain step of the same tokens; None: the
    constant 1 + SPECULATION_OVERHEAD."""
    if cost_ratio is None:
        cost_ratio = 1.0 + SPECULATION_OVERHEAD
    best_k, best = 0, 1.0
    for k in range(1, max_k + 1):
        cost = max(1.0, batch_size * (k + 1) / ridge_tokens) * cost_ratio
        gain = expected_tokens(acceptance, k) / cost
        if gain > best + 1e-9:
            best_k, best = k, gain
    return best_k
