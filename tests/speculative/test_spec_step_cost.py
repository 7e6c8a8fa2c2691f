"""The measured cost of verifying (speculative/step_cost.py) and its use by the adaptive k."""

import pytest

from slipstream.scheduler.output import ScheduledSeq, SchedulerOutput
from slipstream.speculative.adaptive import SPECULATION_OVERHEAD, choose_k
from slipstream.speculative.step_cost import (
    MIN_SAMPLES,
    Ema,
    StepCostEstimator,
    batch_bucket,
    bucket_label,
)


def test_choose_k_uses_the_measured_ratio():
    assert choose_k(1, 4, 0.5, 128, None) == choose_k(1, 4, 0.5, 128, 1 + SPECULATION_OVERHEAD)
    assert choose_k(1, 4, 0.5, 128, 1.28) == 4  # 1.94 tokens for 1.28: pays
    assert choose_k(1, 4, 0.5, 128, 2.0) == 0  # at most 1.94 tokens for 2 plain steps
    assert choose_k(1, 4, 0.7, 128, 1.8) == 4  # 2.77 tokens for 1.8
    assert choose_k(1, 4, 0.7, 128, 2.8) == 0
    assert choose_k(64, 4, 0.7, 128, 1.28) == 1
    assert choose_k(64, 4, 0.7, 128, 1.8) == 0


def test_batch_buckets():
    assert [batch_bucket(b) for b in (1, 2, 4, 5, 16, 17, 64, 65, 1000)] == [0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert [bucket_label(i) for i in range(5)] == ["1", "2-4", "5-16", "17-64", "65+"]


def test_ema_starts_at_its_first_sample():
    ema = Ema(0.5)
    ema.add(4.0)
    assert (ema.value, ema.count) == (4.0, 1)
    ema.add(2.0)
    assert (ema.value, ema.count) == (3.0, 2)


def _fill(est, batch_size, plain_s, verify_s, n=MIN_SAMPLES, num_steps=1, verify_tokens=None):
    for _ in range(n):
        est.record_plain(batch_size, plain_s, num_steps)
        est.record_verify(batch_size, verify_tokens or 2 * batch_size, verify_s)


def test_estimator_needs_samples_of_both_kinds_per_bucket():
    est = StepCostEstimator(ridge_tokens=128)
    _fill(est, 1, 0.010, 0.018, n=MIN_SAMPLES - 1)
    assert est.cost_ratio(1) is None
    est.record_plain(1, 0.010)
    assert est.cost_ratio(1) is None  # verify average still one short
    est.record_verify(1, 5, 0.018)
    assert est.cost_ratio(1) == pytest.approx(1.8)
    assert est.cost_ratio(2) is None  # another bucket
    assert est.ratios() == {"1": pytest.approx(1.8), "2-4": None, "5-16": None, "17-64": None, "65+": None}


def test_estimator_per_token_of_multi_step_and_per_weight_read():
    est = StepCostEstimator(ridge_tokens=128)
    # A plain step that decoded 8 tokens a request costs an eighth per token.
    _fill(est, 3, 0.080, 0.020, num_steps=8)
    assert est.cost_ratio(3) == pytest.approx(2.0)
    # Past the ridge a step's cost is counted per weight read: 256 tokens are two.
    _fill(est, 64, 0.010, 0.025, verify_tokens=256)
    assert est.cost_ratio(64) == pytest.approx(1.25)
    # Never below 1: a cheaper verification is noise.
    _fill(est, 200, 0.010, 0.005)
    assert est.cost_ratio(200) == 1.0


def _step(spec_tokens):
    """A decode step of len(spec_tokens) requests verifying these many drafts each."""
    seqs = [ScheduledSeq(None, [1] * (1 + n), 10, [0], True, num_spec_tokens=n) for n in spec_tokens]
    return SchedulerOutput(seqs=seqs)


def test_decoder_measures_step_times_and_adapts_k():
    from slipstream.speculative.config import SpeculativeConfig
    from slipstream.speculative.decoder import SpeculativeDecoder

    spec = SpeculativeDecoder(
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4}),
        proposer=None,
        max_seq_len=64,
    )
    spec.acceptance = 0.5
    assert spec.num_drafts_for(1) == 4  # the constant 1.28
    now = 0.0
    spec.step_ended(now)
    for _ in range(MIN_SAMPLES + 1):
        spec.step_applied(_step([0]), 1)
        now += 0.010
        spec.step_ended(now)
        spec.step_applied(_step([4]), 1)
        now += 0.025
        spec.step_ended(now)
    # An engine step that read back nothing breaks the chain: the next interval is not a sample.
    spec.step_ended(now + 100.0)
    spec.step_applied(_step([0]), 1)
    spec.step_ended(now + 200.0)
    # A prefill chunk is not measured.
    spec.step_applied(SchedulerOutput(seqs=[ScheduledSeq(None, [1, 2, 3], 0, [0], True)]), 1)
    spec.step_ended(now + 300.0)
    assert spec.step_cost.cost_ratio(1) == pytest.approx(2.5)
    assert spec.num_drafts_for(1) == 0  # 1.94 tokens for 2.5 plain steps does not pay
    assert spec.get_stats()["spec_step_cost_ratio"]["1"] == pytest.approx(2.5)
