"""The scheduler: which requests run each step, with how many tokens, within the token
budget and the free KV blocks (chunked prefill, preemption, priorities).
"""
