"""workers/loop_clock.py: the parts of a worker's tick, per decode step, over a trailing
window (published in WorkerInfo.loop)."""

from __future__ import annotations

from workers.loop_clock import PHASES, LoopClock


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tick(loop: LoopClock, clock: FakeClock, **phases: float) -> None:
    loop.start_tick()
    for phase, seconds in phases.items():
        clock.now += seconds
        loop.lap(phase)
    if "step" in phases:
        loop.stepped()


def summary(loop: LoopClock) -> dict[str, float]:
    """As the worker publishes it: a tick counts once it has ended (the next one began)."""
    loop.start_tick()
    return loop.summary()


def test_each_phase_is_averaged_over_the_decode_steps():
    clock = FakeClock()
    loop = LoopClock(window=5.0, clock=clock)
    for _ in range(4):
        tick(loop, clock, chores=0.001, claim=0.002, step=0.010, writes=0.003)
    # a tick without a step (its writes and its wait for work) counts whole as idle
    tick(loop, clock, writes=0.004, idle=0.036)
    out = summary(loop)
    assert out["steps"] == 4
    assert out["step_ms"] == 10.0 and out["claim_ms"] == 2.0 and out["chores_ms"] == 1.0
    assert out["writes_ms"] == 3.0 and out["ends_ms"] == 0.0
    assert out["idle_ms"] == 10.0  # 40 ms over 4 steps
    assert out["seconds"] == 0.104
    assert out["busy"] == round(1 - 0.040 / 0.104, 3)
    assert {f"{p}_ms" for p in PHASES} <= set(out)


def test_the_summary_covers_the_current_window_and_the_one_before_it_only():
    clock = FakeClock()
    loop = LoopClock(window=1.0, clock=clock)
    for _ in range(24):  # 1.5 s of 62.5 ms steps (binary fractions: exact sums)
        tick(loop, clock, step=0.0625)
    for _ in range(20):  # then 1.25 s of 31.25 ms steps, each beside a 31.25 ms wait
        tick(loop, clock, step=0.03125, writes=0.03125)
    out = summary(loop)
    # the first window (16 slow steps) is gone; the other 8 slow steps remain
    assert out["steps"] == 28
    assert out["step_ms"] == round((8 * 62.5 + 20 * 31.25) / 28, 3)
    assert out["writes_ms"] == round(20 * 31.25 / 28, 3)
    assert out["seconds"] == 1.75


def test_an_idle_worker_reports_no_steps_and_its_idle_time():
    clock = FakeClock()
    loop = LoopClock(window=5.0, clock=clock)
    tick(loop, clock, chores=0.001, idle=0.999)
    out = summary(loop)
    assert out["steps"] == 0 and out["idle_ms"] == 1000.0 and out["busy"] == 0.0
    assert out["chores_ms"] == 0.0  # an idle worker's chores are its idle time
