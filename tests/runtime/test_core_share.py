"""The thread count follows the machine's load (runtime/kernels/core_share.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from runtime.kernels import core_share
from runtime.kernels.core_share import SAMPLE_SECONDS, WINDOW, CoreShare, runnable_elsewhere


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def share(others: list[int | None], cores: int = 2) -> tuple[CoreShare, list[int], Clock]:
    """A CoreShare whose probe reads `others` in turn; the thread counts it set."""
    calls: list[int] = []
    clock = Clock()
    values = iter(others)
    return CoreShare(cores, calls.append, probe=lambda: next(values), clock=clock), calls, clock


def run(cs: CoreShare, clock: Clock, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        clock.now += SAMPLE_SECONDS
        out.append(cs.adjust())
    return out


def test_a_busy_core_takes_a_thread_away_after_a_whole_window():
    cs, calls, clock = share([1] * WINDOW)
    threads = run(cs, clock, WINDOW)
    assert threads == [2] * (WINDOW - 1) + [1]
    assert calls == [1] and cs.changes == 1


def test_the_threads_come_back_when_the_machine_is_quiet_again():
    cs, calls, clock = share([1] * WINDOW + [0] * WINDOW)
    run(cs, clock, 2 * WINDOW)
    assert calls == [1, 2] and cs.threads == 2


def test_mixed_samples_move_nothing():
    cs, calls, clock = share([0, 1] * WINDOW)
    run(cs, clock, 2 * WINDOW)
    assert calls == [] and cs.threads == 2


def test_never_below_one_thread_and_never_above_the_cores():
    cs, calls, clock = share([5] * WINDOW + [0] * WINDOW, cores=4)
    run(cs, clock, WINDOW)
    assert cs.threads == 1
    run(cs, clock, WINDOW)
    assert cs.threads == 4 and calls == [1, 4]


def test_no_sample_between_sample_times():
    cs, _, clock = share([1] * WINDOW)
    for _ in range(3 * WINDOW):  # the clock never moves: one sample only
        cs.adjust()
    assert cs.threads == 2
    run(cs, clock, WINDOW - 1)
    assert cs.threads == 1


def test_without_proc_nothing_changes():
    cs, calls, clock = share([None] * WINDOW)
    run(cs, clock, WINDOW)
    assert calls == [] and cs.threads == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_probe_sees_another_process_running():
    quiet = runnable_elsewhere()
    assert quiet is not None and quiet >= 0
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        seen = []
        for _ in range(20):
            seen.append(runnable_elsewhere())
            time.sleep(0.01)
    finally:
        busy.kill()
        busy.wait()
    assert max(seen) >= 1, seen


def test_the_torch_backend_shares_the_cores_and_fixed_threads_turns_it_off(monkeypatch):
    torch = pytest.importorskip("torch")
    from runtime.kernels import torch_backend

    monkeypatch.setattr(core_share, "_shared", None)  # as in a fresh process
    torch_backend._give_torch_the_cores.cache_clear()
    backend = torch_backend.TorchBackend()
    shared = core_share._shared
    assert shared is not None and shared.cores == backend.plan.threads
    assert torch.get_num_threads() == shared.threads == core_share.threads()
    monkeypatch.setattr(core_share, "_shared", None)
    monkeypatch.setenv("LLMQ_FIXED_THREADS", "1")
    fixed = core_share.share_cores(2, lambda n: None)
    assert fixed._probe() == 0
