"""Text pairs for a cross-encoder: the tokenizer's pair encoding, as token ids plus the index
where the second segment's token type (1) starts.

BERT cross-encoders read `[CLS] a [SEP] b [SEP]` with token type 0 up to the first `[SEP]`
and 1 after it. The engine carries that boundary as one integer per request
(`pooling_params["token_type_start"]`) and the pooling runner turns it back into token type
ids. Tokenizers whose pair encoding has no second token type (decoder cross-encoders) give
None: the model reads the ids alone.
"""

from __future__ import annotations

from typing import Any


def encode_pair(tokenizer: Any, text_1: str, text_2: str) -> tuple[list[int], int | None]:
    """(token ids, first index of token type 1 or None) of the pair, as the tokenizer's own
    pair encoding writes them (its special tokens and separators)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    encoded = hf(text_1, text_2, return_token_type_ids=True)
    ids = list(encoded["input_ids"])
    return ids, type_start(list(encoded.get("token_type_ids") or []))


def type_start(token_types: list[int]) -> int | None:
    """The index where token type 1 starts, or None when every type is 0. ValueError for
    types that are not one run of 0s then one run of 1s (a pair has two segments)."""
    if not any(token_types):
        return None
    start = token_types.index(1)
    if any(t != 0 for t in token_types[:start]) or any(t != 1 for t in token_types[start:]):
        raise ValueError(f"token type ids must be 0s then 1s (two segments), got {token_types}")
    return start


def pair_pooling_params(base: dict, token_type_start: int | None) -> dict:
    """The request's pooling params with the pair's segment boundary, if it has one."""
    if token_type_start is None:
        return base
    return {**base, "token_type_start": token_type_start}
