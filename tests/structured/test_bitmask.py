"""The token bitmask: the plain-PyTorch twin equals xgrammar's kernel, and a constrained row is
masked exactly where its matcher says while other rows stay untouched."""

from __future__ import annotations

import pytest
import torch

from slipstream.structured.bitmask import apply_bitmask, apply_bitmask_reference, bitmask_words


@pytest.mark.parametrize("vocab", [32, 100, 4096 + 7])
def test_reference_twin_equals_xgrammar(vocab):
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    mask = torch.randint(-(2**31), 2**31 - 1, (5, bitmask_words(vocab)), dtype=torch.int32, generator=gen)
    rows = [0, 2, 4]
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, mask, vocab_size=vocab, indices=rows, backend="cpu")
    got = logits.clone()
    apply_bitmask_reference(got, mask, rows)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3]], logits[[1, 3]])
    token = 37 % vocab
    allowed = bool((mask[2, token // 32] >> (token % 32)) & 1)
    assert torch.isinf(got[2, token]).item() is not allowed


@pytest.mark.gpu
def test_device_kernel_equals_twin():
    gen = torch.Generator().manual_seed(0)
    vocab = 151_936
    logits = torch.randn(64, vocab, generator=gen)
    mask = torch.randint(-(2**31), 2**31 - 1, (64, bitmask_words(vocab)), dtype=torch.int32, generator=gen)
    rows = list(range(0, 64, 4))
    want = logits.clone()
    apply_bitmask_reference(want, mask, rows)
    got = logits.cuda()
    apply_bitmask(got, mask.cuda(), rows)
    assert torch.equal(got.cpu(), want)
