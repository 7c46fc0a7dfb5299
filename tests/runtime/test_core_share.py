"""The thread count follows the machine's load (runtime/kernels/core_share.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from runtime.kernels import core_share
from runtime.kernels.core_share import (
    SAMPLE_SECONDS,
    SPAN_SECONDS,
    WINDOW,
    CoreShare,
    CpuElsewhere,
    machine_busy_seconds,
)


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


def test_the_probe_is_other_processes_cpu_time_over_its_span():
    """Machine busy time less this process's own, per second of the span, rounded."""
    clock, busy, own = Clock(), [0.0], [0.0]
    probe = CpuElsewhere(busy=lambda: busy[0], own=lambda: own[0], clock=clock, span=0.5)
    readings = []
    for step in range(20):
        clock.now = step * 0.05
        busy[0] += 0.05 * (2.0 if step >= 10 else 1.2)  # 2 busy cores from step 10
        own[0] += 0.05 * 1.0  # this process: one core throughout
        readings.append(probe())
    assert readings[:5] == [None] * 5  # less than half a span seen
    assert readings[5:10] == [0] * 5  # 0.2 of a core elsewhere rounds to none
    assert readings[-1] == 1  # a whole core elsewhere once the span is past the change


def test_machine_busy_time_reads_procs_cpu_line():
    line = "cpu  100 20 30 400 50 6 4 9 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"
    assert machine_busy_seconds(line) == pytest.approx((100 + 20 + 30 + 6 + 4) / _clk_tck())
    assert machine_busy_seconds("cpu  1 2\n") is None


def _clk_tck() -> int:
    import os

    return os.sysconf("SC_CLK_TCK")


def _sample(probe: CpuElsewhere, seconds: float, before=None) -> list[int | None]:
    readings = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if before is not None:
            before()
        readings.append(probe())
        time.sleep(SAMPLE_SECONDS)
    return readings


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_probe_sees_another_process_running():
    probe = CpuElsewhere()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        readings = _sample(probe, 3 * SPAN_SECONDS)
    finally:
        busy.kill()
        busy.wait()
    assert readings[-1] is not None and readings[-1] >= 1, readings


BURST = """
import os, sys, time
print("ready", flush=True)
while os.read(int(sys.argv[1]), 1):
    start = time.perf_counter()
    while time.perf_counter() - start < 0.002:
        pass
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_process_woken_at_every_sample_is_not_a_busy_core():
    """What a worker sees at every step: its write wakes the API, Redis and the clients just
    before it samples. They are runnable then, but use a sliver of a core. The machine's busy
    time is this process's and the helper's alone here, so that whatever else shares the
    machine (two busy loops beside the suite read 2 cores) is not counted."""
    import os

    read_end, write_end = os.pipe()
    helper = subprocess.Popen(
        [sys.executable, "-c", BURST, str(read_end)], pass_fds=[read_end], stdout=subprocess.PIPE
    )
    os.close(read_end)
    helper_cpu = psutil.Process(helper.pid).cpu_times

    def busy() -> float:  # as machine_busy_seconds, over this process and the helper only
        times = helper_cpu()
        return time.process_time() + times.user + times.system

    try:
        assert helper.stdout is not None and helper.stdout.readline() == b"ready\n"
        probe = CpuElsewhere(busy=busy)
        readings = _sample(probe, 4 * SPAN_SECONDS, lambda: os.write(write_end, b"x"))
    finally:
        os.close(write_end)
        helper.wait(10)
        helper.stdout.close()
    seen = [r for r in readings if r is not None]
    assert seen and seen.count(0) >= 0.9 * len(seen), readings


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
