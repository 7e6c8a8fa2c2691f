"""as_token_ids: a plain list of ints takes a fast path in C; everything else is still checked
one by one, so the fast path must not let a bool, a float or a string through."""

from __future__ import annotations

import numpy as np
import pytest

from slipstream.engine.frontend import as_token_ids


def test_plain_ints_come_back_as_a_copy() -> None:
    ids = list(range(500))
    out = as_token_ids(ids)
    assert out == ids and out is not ids


@pytest.mark.parametrize(
    "prompt, want", [((1, 2), [1, 2]), ([np.int64(3), 4], [3, 4]), ([], []), (range(3), [0, 1, 2])]
)
def test_other_integer_sequences(prompt, want) -> None:
    out = as_token_ids(prompt)
    assert out == want and all(type(t) is int for t in out)


@pytest.mark.parametrize("bad", [[1, True], [False], [1, 2.0], [1, "2"], "12", b"12", {1: 2}, 7])
def test_non_integers_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="token ids must be"):
        as_token_ids(bad)
