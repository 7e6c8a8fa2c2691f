"""scripts/eval_quant_ppl.py's measuring helpers: greedy agreement, windows, prompts, text sets."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "eval_quant_ppl.py"


@pytest.fixture(scope="module")
def ev():
    spec = importlib.util.spec_from_file_location("eval_quant_ppl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_greedy_agreement_counts_tokens_before_the_first_difference(ev) -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    got = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]  # after a difference nothing counts
    assert ev.greedy_agreement(ref, got) == {"prefix": 6 / 12, "identical": 1 / 3}
    assert ev.greedy_agreement(ref, ref) == {"prefix": 1.0, "identical": 1.0}
    assert ev.greedy_agreement([[1, 2]], [[1]]) == {"prefix": 0.5, "identical": 0.0}
    with pytest.raises(ValueError):
        ev.greedy_agreement(ref, got[:2])


def test_windows_round_robin_and_prompts_spread(ev) -> None:
    texts = [list(range(10)), list(range(100, 105)), list(range(200, 207))]
    # seq_len 2: windows of 3 ids, non-overlapping predictions; every text comes first once.
    assert ev.windows(texts, 2, 4) == [[0, 1, 2], [100, 101, 102], [200, 201, 202], [2, 3, 4]]
    prompts = ev.agreement_prompts(texts, 4, 3)
    assert len(prompts) == 4 and all(len(p) == 3 for p in prompts)
    assert prompts[0] == [0, 1, 2] and prompts[-1][0] > 100


def test_text_sets_are_named_files_of_this_python(ev) -> None:
    for name in ev.TEXT_SETS:
        texts = ev.text_set(name)
        assert texts and all(len(t) > 1000 for t in texts)
    assert "Python Software Foundation" in ev.text_set("prose")[0]
