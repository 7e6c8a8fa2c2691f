"""speculative_config checking, the n-gram lookup, the adaptive choice of k, the CLI flag and
the /metrics families."""

from __future__ import annotations

import argparse

import pytest

from slipstream.engine.args import EngineArgs
from slipstream.serve.metrics import EngineStatsCollector
from slipstream.speculative.adaptive import choose_k, expected_tokens
from slipstream.speculative.config import SpeculativeConfig
from slipstream.speculative.ngram import lookup


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "nope", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "mtp", "num_speculative_tokens": 2}, "not implemented"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "eagle", "num_speculative_tokens": 2, "model": "/no/such"}, "not a directory"),
        ({"method": "oracle", "num_speculative_tokens": 2, "speculative_token_tree": [[0, 0]]}, "no parent"),
        (
            {"method": "oracle", "num_speculative_tokens": 2, "speculative_token_tree": "[[0], oops"},
            "not a list",
        ),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"\[1, 16\]"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": "/no/such"}, "config.json"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_configs_are_value_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(bad)


def test_cli_flag_reaches_the_engine_config(tiny_llama_dir):
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(
        [
            "--model",
            str(tiny_llama_dir),
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}',
        ]
    )
    spec = EngineArgs.from_cli_args(ns).create_engine_config().speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 2)
    assert (
        SpeculativeConfig.from_dict({"model": str(tiny_llama_dir), "num_speculative_tokens": 2}).method
        == "draft_model"
    )


def test_draft_model_needs_the_targets_vocabulary(tiny_checkpoint):
    from slipstream import LLM

    draft = tiny_checkpoint("LlamaForCausalLM", vocab_size=256)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(
            str(tiny_checkpoint("LlamaForCausalLM")),
            device="cpu",
            speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2},
        )


def test_ngram_lookup_prefers_the_longest_then_latest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]
    assert lookup(tokens, 1, 3, 2) == [7, 5]  # suffix [2, 3]: latest earlier match at 5
    assert lookup([1, 2, 3, 4], 1, 3, 2) == []
    assert lookup([4, 4, 4], 1, 2, 3) == [4]  # only what exists after the match


def test_adaptive_k_speculates_fully_alone_and_not_at_large_batches():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert choose_k(1, 4, 0.7, 128) == 4
    assert 0 < choose_k(32, 4, 0.7, 128) < 4
    assert choose_k(128, 4, 0.7, 128) == 0
    assert choose_k(1, 4, 0.0, 128) == 0  # drafts never accepted: no speculation
    # A speculating step costs more than a plain one even at batch 1: poor acceptance stops it.
    assert choose_k(1, 4, 0.15, 128) == 0


def test_adaptive_k_probes_while_off():
    from slipstream.speculative.config import SpeculativeConfig
    from slipstream.speculative.decoder import _PROBE_EVERY, SpeculativeDecoder

    spec = SpeculativeDecoder(
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4}),
        proposer=None,
        max_seq_len=64,
    )
    spec.acceptance = 0.0
    assert spec.num_drafts_for(1) == 0
    due = [spec._probe_due(1) for _ in range(3 * _PROBE_EVERY)]
    assert sum(due) == 3 and due[_PROBE_EVERY - 1]


def test_metrics_families_per_method():
    stats = {
        "speculative": {
            "ngram": {
                "num_draft_tokens": 10,
                "num_accepted_tokens": 4,
                "acceptance_rate": 0.4,
                "mean_accepted_length": 1.8,
            }
        }
    }
    families = {f.name: f for f in EngineStatsCollector(lambda: stats).collect()}
    accepted = families["slipstream_spec_decode_num_accepted_tokens"].samples
    assert [(s.labels, s.value) for s in accepted if s.name.endswith("_total")] == [
        ({"method": "ngram"}, 4.0)
    ]
    rate = families["slipstream_spec_decode_acceptance_rate"].samples
    assert [(s.labels, s.value) for s in rate] == [({"method": "ngram"}, 0.4)]
