"""The CPU float32 LM head's transposed copy for decode rows (layers/embedding.py)."""

from __future__ import annotations

import torch

from slipstream.layers import embedding
from slipstream.layers.embedding import LMHead


def _head() -> LMHead:
    head = LMHead(300, 48, torch.float32)
    head.weight.data.copy_(torch.randn(300, 48, generator=torch.Generator().manual_seed(0)))
    return head


def test_decode_rows_use_the_copy_and_match_f_linear():
    head = _head()
    for rows in (1, embedding.CPU_TRANSPOSED_HEAD_MAX_ROWS, 5):
        x = torch.randn(rows, 48, generator=torch.Generator().manual_seed(rows))
        want = torch.nn.functional.linear(x, head.weight)
        torch.testing.assert_close(head(x), want, rtol=1e-5, atol=1e-5)
    assert head._cpu_weight_t is not None and head._cpu_weight_t.shape == (48, 300)


def test_the_copy_follows_the_weight():
    head = _head()
    x = torch.randn(1, 48)
    before = head(x)
    with torch.no_grad():
        head.weight.mul_(-1)  # e.g. weights loaded again in place
    torch.testing.assert_close(head(x), -before)
    head.weight = torch.nn.Parameter(torch.zeros(300, 48), requires_grad=False)
    assert torch.equal(head(x), torch.zeros(1, 300))
