"""Sampling: logits -> token ids (greedy, temperature, top-k/p, min-p, penalties, seeds, logprobs)."""
