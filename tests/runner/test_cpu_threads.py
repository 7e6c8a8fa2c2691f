"""The CPU engine's torch thread count (runner/cpu_threads.py), affinity and load mocked."""
from __future__ import annotations

import pytest
import torch

from slipstream.runner import cpu_threads as ct


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch: pytest.MonkeyPatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    ct._reset_for_tests()
    yield
    torch.set_num_threads(before)
    ct._reset_for_tests()


def test_physical_cores_counts_smt_siblings_once() -> None:
    siblings = {0: "0,4", 1: "1,5", 2: "2,6", 3: "3,7", 4: "0,4", 5: "1,5", 6: "2,6", 7: "3,7"}
    assert ct.physical_cores(range(8), siblings.get) == 4
    assert ct.physical_cores({0, 1, 4}, siblings.get) == 2  # cpus 0 and 4 share a core
    assert ct.physical_cores({0, 1}, lambda cpu: None) == 2  # no topology: one core a CPU
    assert ct.physical_cores(range(4), {c: "0-1" if c < 2 else "2-3" for c in range(4)}.get) == 2


def test_busy_cores_subtracts_own_share() -> None:
    assert ct.busy_cores(lambda: (1.2, 0, 0), lambda: 0.0) == 1
    assert ct.busy_cores(lambda: (2.4, 0, 0), lambda: 1.0) == 1
    assert ct.busy_cores(lambda: (0.3, 0, 0), lambda: 0.9) == 0


@pytest.mark.parametrize("cores,busy,reserve,want", [
    (8, 0, 0, 8), (8, 3, 0, 5), (2, 1, 0, 1), (2, 5, 0, 1), (4, 1, 1, 2), (1, 0, 1, 1),
])
def test_auto_threads(cores: int, busy: int, reserve: int, want: int) -> None:
    assert ct.auto_threads(reserve, cores=cores, busy=busy) == want


def _mock_machine(monkeypatch: pytest.MonkeyPatch, cores: int, busy: int) -> None:
    monkeypatch.setattr(ct, "physical_cores", lambda *a, **k: cores)
    monkeypatch.setattr(ct, "busy_cores", lambda *a, **k: busy)
    monkeypatch.setattr(ct, "torch_default_threads", lambda: {torch.get_num_threads()})


def test_configure_sets_auto_count_once(monkeypatch: pytest.MonkeyPatch) -> None:
    _mock_machine(monkeypatch, cores=3, busy=1)
    assert ct.configure_cpu_threads() == 2
    assert torch.get_num_threads() == 2
    _mock_machine(monkeypatch, cores=3, busy=0)  # a later engine in this process keeps it
    assert ct.configure_cpu_threads() == 2


def test_explicit_count_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    _mock_machine(monkeypatch, cores=4, busy=0)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert ct.configure_cpu_threads(1) == 1
    assert torch.get_num_threads() == 1
    with pytest.raises(ValueError):
        ct.choose_threads(0)


def test_omp_num_threads_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    _mock_machine(monkeypatch, cores=4, busy=0)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    n, why = ct.choose_threads()
    assert n is None and "OMP_NUM_THREADS" in why


def test_users_torch_set_num_threads_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ct, "physical_cores", lambda *a, **k: 4)
    monkeypatch.setattr(ct, "busy_cores", lambda *a, **k: 0)
    monkeypatch.setattr(ct, "torch_default_threads", lambda: {4})
    torch.set_num_threads(1)  # not a count torch starts with: the user's
    n, why = ct.choose_threads()
    assert n is None and "set_num_threads" in why
    assert ct.configure_cpu_threads() == 1


def test_engine_args_cli_and_config() -> None:
    import argparse

    from slipstream.engine.args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--cpu-threads", "3"]))
    assert args.cpu_threads == 3
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineArgs(cpu_threads=0, device="cpu").create_engine_config()
