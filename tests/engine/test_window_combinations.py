"""Sliding windows beside other features: beam search forks past released blocks (same beams
as transformers), what keeps blocks behind the window, and the combinations refused."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from slipstream import LLM
from slipstream.config import ModelConfig
from slipstream.engine.core import _releasable_window
from slipstream.models.registry import check_parallel_support
from slipstream.sampling.beam_search import BeamSearchParams
from tests.engine.test_beam_search import PROMPT, assert_same_beams, hf_beams
from tests.helpers import load_hf_model, tiny_config

WINDOW = 8


@pytest.fixture(scope="module")
def windowed(tiny_checkpoint):
    return tiny_checkpoint("MistralForCausalLM", sliding_window=WINDOW)


def test_beam_search_past_the_window_matches_transformers(windowed):
    """Blocks of 4: by the end each beam's first blocks are released, and forks after that
    share only the held ones; every block comes back."""
    llm = LLM(str(windowed), device="cpu", dtype="float32", max_model_len=64, block_size=4)
    kv = llm.engine.scheduler.kv
    assert kv.sliding_window == WINDOW
    params = BeamSearchParams(beam_width=3, max_tokens=14, ignore_eos=True)
    (out,) = llm.beam_search([PROMPT], params)
    assert_same_beams(out, hf_beams(load_hf_model(windowed), PROMPT, 3, 14, 1.0, None), 1.0)
    assert kv.num_free_blocks == kv.num_total_blocks


def test_draft_trees_refused_on_windowed_models(windowed):
    tree = {"method": "oracle", "num_speculative_tokens": 2,
            "speculative_token_tree": [[0], [1], [0, 0]]}
    with pytest.raises(ValueError, match="draft trees"):
        LLM(str(windowed), device="cpu", dtype="float32", max_model_len=64,
            speculative_config=tree)


def _config(method: str | None):
    model = ModelConfig.from_hf_dict(tiny_config("MistralForCausalLM",
                                                 sliding_window=WINDOW).to_dict())
    spec = None if method is None else SimpleNamespace(method=method)
    return SimpleNamespace(model=model, speculative=spec,
                           scheduler=SimpleNamespace(max_model_len=64))


@pytest.mark.parametrize("method,window", [(None, WINDOW), ("ngram", WINDOW), ("draft_model", None),
                                           ("eagle", None), ("eagle3", None)])
def test_proposers_reading_the_target_tables_keep_blocks(method, window):
    assert _releasable_window(_config(method)) == window


def test_pipeline_parallel_refused_for_whole_model_families():
    for arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "GPT2LMHeadModel"):
        check_parallel_support(arch, 2, 1)
        with pytest.raises(ValueError, match="pipeline parallelism"):
            check_parallel_support(arch, 1, 2)
    check_parallel_support("Phi3ForCausalLM", 2, 2)
    check_parallel_support("LlamaForCausalLM", 2, 2)
