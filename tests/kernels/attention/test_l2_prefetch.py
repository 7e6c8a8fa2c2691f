"""The L2 prefetch's span tables (kernels/attention/l2_spans.py) and its standalone launch."""
from __future__ import annotations

import pytest
import torch

from slipstream.kernels.attention.l2_spans import SPAN_BYTES, budget_bytes, chunk_bytes, span_table


def _covered(table: torch.Tensor) -> list[tuple[int, int]]:
    """The table's spans merged into contiguous (start, end) byte ranges."""
    ranges: list[tuple[int, int]] = []
    for addr, n in table.tolist():
        if ranges and ranges[-1][1] == addr:
            ranges[-1] = (ranges[-1][0], addr + n)
        else:
            ranges.append((addr, addr + n))
    return ranges


def test_first_group_whole_then_the_same_leading_share_of_each_tensor() -> None:
    o = torch.empty(1 << 20, dtype=torch.uint8)  # 1 MiB
    w, s = torch.empty(4 << 20, dtype=torch.uint8), torch.empty(1 << 20, dtype=torch.uint8)
    table = span_table([[o], [w, s]], (1 << 20) + (5 << 20) // 2, torch.device("cpu"))
    assert table.dtype == torch.int64 and table.shape[1] == 2
    assert all(0 < n <= SPAN_BYTES and n % 16 == 0 and a % 16 == 0 for a, n in table.tolist())
    assert _covered(table) == [(o.data_ptr(), o.data_ptr() + (1 << 20)),
                               (w.data_ptr(), w.data_ptr() + (2 << 20)),  # half of each
                               (s.data_ptr(), s.data_ptr() + (1 << 19))]


def test_budget_limits_the_first_group_too_and_zero_means_none() -> None:
    o = torch.empty(1 << 20, dtype=torch.uint8)
    table = span_table([[o], [torch.empty(64, dtype=torch.uint8)]], 1 << 18, torch.device("cpu"))
    assert int(table[:, 1].sum()) == 1 << 18
    assert span_table([[o]], 0, torch.device("cpu")) is None
    assert span_table([[torch.empty(0)]], 1 << 20, torch.device("cpu")) is None


def test_ragged_views_are_aligned_inward() -> None:
    base = torch.empty(1000, dtype=torch.uint8)
    view = base[3:997]  # starts 3 bytes in, ends 3 bytes before the end
    (addr, n), = span_table([[view]], 1 << 20, torch.device("cpu")).tolist()
    assert addr % 16 == 0 and addr >= view.data_ptr() and n % 16 == 0
    assert addr + n <= view.data_ptr() + view.numel()
    assert n >= view.numel() - 30


def test_non_contiguous_tensors_are_skipped() -> None:
    t = torch.empty(64, 64).t()
    assert span_table([[t]], 1 << 20, torch.device("cpu")) is None


def test_chunks_cover_a_span() -> None:
    for warps in (1, 2, 4, 8):
        c = chunk_bytes(warps)
        assert c % 16 == 0 and c * 32 * warps >= SPAN_BYTES


def test_no_budget_without_an_l2_to_warm() -> None:
    assert budget_bytes() == 0 and budget_bytes(torch.device("cpu")) == 0


def test_int4_awq_goes_without(monkeypatch) -> None:
    """l2_spans.NO_PREFETCH_METHODS: int4_awq's budget is 0 on a device that could prefetch."""
    from slipstream.kernels.attention import l2_spans

    monkeypatch.setattr(l2_spans, "supported", lambda device: True)
    assert budget_bytes(torch.device("cuda"), "int4_awq") == 0


def test_standalone_launch_records_every_span_once() -> None:
    """prefetch_spans' RECORD mode (the interpreter): however many programs share the table,
    each span is taken exactly once."""
    from slipstream.kernels.attention.l2_prefetch import RECORD, RECORD_MARK, _prefetch_kernel

    w = torch.empty(3 << 20, dtype=torch.uint8)
    table = span_table([[w]], 3 << 20, torch.device("cpu"))
    before = table.clone()
    for programs in (1, 5, 64):  # fewer, and more, programs than the table's 24 spans
        _prefetch_kernel[(programs,)](table, table.shape[0], 512, MODE=RECORD)
    assert torch.equal(table[:, 0], before[:, 0])
    assert torch.equal(table[:, 1], before[:, 1] + 3 * RECORD_MARK)


@pytest.mark.gpu
def test_gpu_default_budget_is_half_the_l2() -> None:
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    want = l2 // 2 if torch.cuda.get_device_capability(dev) >= (9, 0) else 0
    assert budget_bytes(dev) == want
    assert budget_bytes(dev, "fp8") == want and budget_bytes(dev, "int4_awq") == 0


@pytest.mark.gpu
def test_gpu_standalone_prefetch_runs_and_changes_nothing() -> None:
    from slipstream.kernels.attention.l2_prefetch import prefetch

    w = [torch.randn(4096, 1024, device="cuda"), torch.randn(1000, device="cuda")[1:]]
    before = [t.clone() for t in w]
    table = span_table([w], 64 << 20, torch.device("cuda"))
    for warps in (1, 4, 8):
        prefetch(table, num_warps=warps)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(w, before, strict=True))
