"""Beam search against transformers' generate(num_beams=k, early_stopping=True): sequences and
scores, with and without EOS, in-flight beside ordinary requests, under KV pressure (preemption
and forks without a free block), and no block leaked after aborts."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from slipstream import LLM, SamplingParams
from slipstream.engine.request import Request
from slipstream.sampling.beam_search import BeamSearchParams

PROMPT = [5, 17, 99, 250, 8, 41, 3]
OTHER = [300, 12, 7, 7, 81]
SCORE_ATOL = 1e-4


@pytest.fixture(scope="module")
def eos_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with EOS = a token its beams meet early (331: third token of the best
    beam of PROMPT), so hypotheses finish at different lengths."""
    path = tmp_path_factory.mktemp("beam_eos")
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = 331
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "generation_config.json").unlink(missing_ok=True)
    return path


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return _llm(tiny_llama_dir, async_scheduling=True)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from tests.helpers import load_hf_model

    return load_hf_model(tiny_llama_dir)


@torch.no_grad()
def hf_beams(model, prompt, k, max_new, length_penalty, eos):
    g = model.generate(torch.tensor([prompt]), num_beams=k, do_sample=False, early_stopping=True,
                       max_new_tokens=max_new, num_return_sequences=k, eos_token_id=eos,
                       pad_token_id=0, length_penalty=length_penalty, output_scores=True,
                       return_dict_in_generate=True)
    lengths = ((g.beam_indices + 1).bool()).sum(dim=1).tolist()
    return [(row[len(prompt):len(prompt) + n].tolist(), float(score))
            for row, n, score in zip(g.sequences, lengths, g.sequences_scores)]


def assert_same_beams(ours, theirs, length_penalty):
    assert len(ours.sequences) == len(theirs)
    for seq, (tokens, score) in zip(ours.sequences, theirs):
        assert seq.output_token_ids == tokens
        assert abs(seq.score - score) < SCORE_ATOL
        assert abs(seq.cum_logprob - score * len(tokens) ** length_penalty) < 1e-3


def _llm(path, **kw):
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=128, max_num_tokens=128,
               **kw)


@pytest.mark.parametrize("k,length_penalty", [(3, 1.0), (4, 0.5)])
def test_matches_transformers_without_eos(llm, hf_model, k, length_penalty):
    params = BeamSearchParams(beam_width=k, max_tokens=10, ignore_eos=True,
                              length_penalty=length_penalty)
    (out,) = llm.beam_search([PROMPT], params)
    assert_same_beams(out, hf_beams(hf_model, PROMPT, k, 10, length_penalty, None), length_penalty)
    assert out.sequences[0].tokens == PROMPT + out.sequences[0].output_token_ids
    _assert_clean(llm.engine)


def test_matches_transformers_with_eos_and_kv_pressure(eos_dir, hf_model):
    """EOS ends hypotheses early; a cache of 6 blocks for two searches of 4 beams forces
    preemptions, forks that find no free block and beams that wait for a queued sibling."""
    llm = _llm(eos_dir, kv_cache_memory=6 * 8192)
    assert llm.engine_config.cache.num_blocks == 6
    params = BeamSearchParams(beam_width=4, max_tokens=12, length_penalty=0.5)
    outs = llm.beam_search([PROMPT, OTHER], params)
    llm.engine.add_beam_search("streamed", PROMPT, params, (331,))
    settled, result = [], None
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        settled += llm.engine.beams.take_progress().get("streamed", [])
        result = llm.engine.beams.take_finished().get("streamed", result)
    assert [s.output_token_ids for s in result.sequences] == [
        s.output_token_ids for s in outs[0].sequences]
    assert_settled_prefix(settled, result)  # finished hypotheses count among the live ones
    for prompt, out in zip([PROMPT, OTHER], outs):
        assert_same_beams(out, hf_beams(hf_model, prompt, 4, 12, 0.5, 331), 0.5)
    reasons = {s.finish_reason for s in outs[0].sequences}
    assert "stop" in reasons and outs[0].sequences[0].output_token_ids  # EOS met and kept
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_clean(llm.engine)


def test_in_flight_with_sampled_requests_and_aborts(llm, hf_model):
    engine = llm.engine
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, seed=11, max_tokens=8, ignore_eos=True)
    alone = llm.generate([OTHER], sampled, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_beam_search("keep", PROMPT, params)
    engine.add_beam_search("drop", OTHER, params)
    engine.add_request(Request("plain", OTHER, sampled))
    got, results, settled = [], {}, {"keep": [], "drop": []}
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        if step == 3:  # mid-search: its beams have forked by now
            assert len([r for r in engine.scheduler.requests if r.startswith("drop")]) == 3
            engine.abort_requests(["drop"])
        for out in engine.step():
            if out.request_id == "plain":
                got += out.new_token_ids
        for search_id, tokens in engine.beams.take_progress().items():
            assert search_id not in results  # nothing settles after the result
            settled[search_id] += tokens
        results.update(engine.beams.take_finished())
    assert got == alone  # a seeded sample does not depend on its batch
    assert set(results) == {"keep"}
    assert_same_beams(results["keep"], hf_beams(hf_model, PROMPT, 3, 8, 1.0, None), 1.0)
    assert_settled_prefix(settled["keep"], results["keep"])
    _assert_clean(engine)


def assert_settled_prefix(settled: list[int], out) -> None:
    """Streamed tokens: what every hypothesis began with before the search ended, so a prefix
    of each final one (and not empty on these prompts: the beams agree on their start)."""
    assert settled
    for seq in out.sequences:
        assert seq.output_token_ids[: len(settled)] == settled


def test_bad_parameters(llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="at most 10"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.5)
    with pytest.raises(ValueError, match="does not fit"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=122))
    _assert_clean(llm.engine)


def _assert_clean(engine) -> None:
    kv = engine.scheduler.kv
    assert not engine.has_unfinished_requests() and not engine.beams.active
    assert kv.num_free_blocks == kv.num_total_blocks
    assert not any(kv.pool.ref_cnt)


def test_search_that_fills_the_context(tiny_llama_dir, hf_model):
    """prompt + max_tokens == max_model_len: the scheduler ends the beams by length at the
    search's last step, as the search itself does."""
    llm = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=16)
    params = BeamSearchParams(beam_width=2, max_tokens=9, ignore_eos=True)
    (out,) = llm.beam_search([PROMPT], params)
    assert_same_beams(out, hf_beams(hf_model, PROMPT, 2, 9, 1.0, None), 1.0)
    _assert_clean(llm.engine)
