"""GPU: a BERT cross-encoder scores text pairs on CUDA (token type ids built on the device)
equal to transformers, batched with single texts."""

from __future__ import annotations

import pytest
import torch

from slipstream import LLM

pytestmark = pytest.mark.gpu


@torch.no_grad()
def test_bert_pair_scores_on_cuda(tiny_bert_cross_encoder_dir):
    import transformers

    llm = LLM(
        str(tiny_bert_cross_encoder_dir), device="cuda", dtype="float32", max_num_seqs=8, max_num_tokens=256
    )
    hf = transformers.BertForSequenceClassification.from_pretrained(
        tiny_bert_cross_encoder_dir, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_bert_cross_encoder_dir)
    query, docs = "what jumps?", ["the quick brown fox", "a cat sat on the mat", "hello"] * 3
    for doc, out in zip(docs, llm.score(query, docs)):
        want = hf(**tok(query, doc, return_tensors="pt")).logits[0, 0].sigmoid().item()
        assert abs(out.outputs.score - want) < 2e-4
