"""Pooling models against transformers: embeddings (last / mean / CLS, normalisation,
Matryoshka dimensions), classification and scoring, batched through the scheduler."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream import LLM, PoolingParams

ATOL = 1e-4  # float32 on both sides
PROMPTS = [[5, 17, 99, 250, 8, 41, 3], [7, 8], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109,
                                                 110, 111, 112, 113, 114, 115, 116, 117]]


def _engine(path, **kw):
    return LLM(str(path), device="cpu", dtype="float32", max_num_seqs=2, max_num_tokens=64, **kw)


@torch.no_grad()
def _hf_hidden(cls_name: str, path, ids: list[int]) -> torch.Tensor:
    import transformers

    model = getattr(transformers, cls_name).from_pretrained(path, dtype=torch.float32).eval()
    return model(torch.tensor([ids])).last_hidden_state[0]


def _close(got: list[float], want: torch.Tensor) -> None:
    assert len(got) == want.numel()
    assert torch.allclose(torch.tensor(got), want.float(), atol=ATOL), (got[:4], want[:4])


@pytest.fixture(scope="module")
def mean_llm(tiny_llama_dir):
    return _engine(tiny_llama_dir, runner="pooling", pooling_type="mean")


def test_causal_lm_as_embedder_mean_pooling(mean_llm, tiny_llama_dir):
    outs = mean_llm.embed(PROMPTS, PoolingParams(normalize=False))
    normed = mean_llm.embed(PROMPTS)  # normalised by default
    for ids, out, unit in zip(PROMPTS, outs, normed):
        ref = _hf_hidden("AutoModel", tiny_llama_dir, ids).mean(0)
        assert out.prompt_token_ids == ids
        _close(out.outputs.embedding, ref)
        _close(unit.outputs.embedding, F.normalize(ref, dim=0))
    kv = mean_llm.engine.scheduler.kv  # three prompts over two seats, nothing kept after
    assert kv.num_free_blocks == kv.num_total_blocks
    assert not mean_llm.engine.has_unfinished_requests()


def test_pooling_engine_refuses_generation_and_bad_options(mean_llm):
    with pytest.raises(ValueError, match="pooling model"):
        mean_llm.generate([[1, 2, 3]])
    with pytest.raises(ValueError, match="matryoshka"):
        mean_llm.embed([[1, 2, 3]], PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="max_num_tokens"):  # whole prompts only, no chunks
        mean_llm.embed([list(range(1, 80))])
    with pytest.raises(ValueError, match="positive integer"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="no classification head"):
        mean_llm.classify([[1, 2]])
    kv = mean_llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_total_blocks


def test_headless_qwen3_last_token_with_matryoshka_dimensions(tiny_qwen3_embed_dir):
    llm = _engine(tiny_qwen3_embed_dir)  # Qwen3Model: a pooling model by its architecture
    assert llm.engine_config.runner == "pooling"
    full = llm.embed(PROMPTS, PoolingParams(normalize=False))
    short = llm.embed(PROMPTS, PoolingParams(dimensions=16))
    for ids, a, b in zip(PROMPTS, full, short):
        ref = _hf_hidden("Qwen3Model", tiny_qwen3_embed_dir, ids)[-1]
        _close(a.outputs.embedding, ref)
        _close(b.outputs.embedding, F.normalize(ref[:16], dim=0))
    with pytest.raises(ValueError, match="at most"):
        llm.embed([[1, 2]], PoolingParams(dimensions=65))


def test_bert_cls_and_sentence_transformers_mean(tiny_bert_dir, tiny_bert_mean_dir):
    cls_llm = _engine(tiny_bert_dir)
    assert cls_llm.engine_config.pooler.pooling_type == "cls"
    mean_llm = _engine(tiny_bert_mean_dir)  # modules.json + 1_Pooling say mean, normalised
    assert mean_llm.engine_config.pooler.pooling_type == "mean"
    cls_out = cls_llm.embed(PROMPTS, PoolingParams(normalize=False))
    mean_out = mean_llm.embed(PROMPTS)
    for ids, c, m in zip(PROMPTS, cls_out, mean_out):
        ref = _hf_hidden("BertModel", tiny_bert_dir, ids)
        _close(c.outputs.embedding, ref[0])
        _close(m.outputs.embedding, F.normalize(ref.mean(0), dim=0))
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(str(tiny_bert_dir), device="cpu", runner="generate")


@torch.no_grad()
def test_bert_classifier_probabilities(tiny_bert_cls_dir):
    import transformers

    llm = _engine(tiny_bert_cls_dir)
    hf = transformers.BertForSequenceClassification.from_pretrained(
        tiny_bert_cls_dir, dtype=torch.float32).eval()
    for ids, out in zip(PROMPTS, llm.classify(PROMPTS)):
        probs = hf(torch.tensor([ids])).logits[0].softmax(-1)
        _close(out.outputs.probs, probs)
    with pytest.raises(ValueError, match="classification model"):
        llm.embed([[1, 2]])


@torch.no_grad()
def test_cross_encoder_and_embedding_scores(tiny_llama_cls_dir, mean_llm):
    import transformers

    llm = _engine(tiny_llama_cls_dir)
    hf = transformers.LlamaForSequenceClassification.from_pretrained(
        tiny_llama_cls_dir, dtype=torch.float32).eval()
    docs = ["the quick brown fox", "hello world"]
    scores = llm.score("what jumps?", docs)
    for doc, out in zip(docs, scores):
        ids = llm.tokenizer.hf("what jumps?", doc)["input_ids"]
        assert out.prompt_token_ids == list(ids)
        want = hf(torch.tensor([ids])).logits[0, 0].sigmoid()
        assert abs(out.outputs.score - want.item()) < ATOL
    # An embedding model scores by cosine similarity.
    (pair,) = mean_llm.score([PROMPTS[0]], [PROMPTS[1]])
    a, b = (torch.tensor(o.outputs.embedding) for o in mean_llm.embed(PROMPTS[:2]))
    assert abs(pair.outputs.score - F.cosine_similarity(a, b, dim=0).item()) < ATOL


@torch.no_grad()
def test_bert_cross_encoder_scores_pairs_with_token_types(tiny_bert_cross_encoder_dir):
    import transformers

    llm = _engine(tiny_bert_cross_encoder_dir)
    hf = transformers.BertForSequenceClassification.from_pretrained(
        tiny_bert_cross_encoder_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_bert_cross_encoder_dir)
    query, docs = "what jumps?", ["the quick brown fox", "a cat sat on the mat", "hello"]
    scores = llm.score(query, docs)  # one batch: pairs of different lengths side by side
    for doc, out in zip(docs, scores):
        enc = tok(query, doc, return_tensors="pt")
        assert enc["token_type_ids"].any()  # the second segment really is type 1
        assert out.prompt_token_ids == enc["input_ids"][0].tolist()
        want = hf(**enc).logits[0, 0].sigmoid().item()
        assert abs(out.outputs.score - want) < ATOL
        wrong = hf(input_ids=enc["input_ids"]).logits[0, 0].sigmoid().item()
        assert abs(out.outputs.score - wrong) > 10 * ATOL  # the token types matter
    # A single text keeps type 0 throughout, in the same engine.
    (single,) = llm.classify([query])
    want = hf(**tok(query, return_tensors="pt")).logits[0, 0].sigmoid().item()
    assert abs(single.outputs.probs[0] - want) < ATOL


def test_generate_engine_refuses_embed(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, max_num_tokens=64)
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.embed([[1, 2, 3]])
