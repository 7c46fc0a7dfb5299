"""Where a worker's loop spends its time, per decode step, published with its heartbeat.

Through the API a GPU worker made 26-33 tokens a second per stream at 1 and at 32 streams
while the same engine in-process made 435 at one (bench/RESULTS.md "GPU"; the run:
bench/log/2026-11-27-gpu-h200-decode-graphs.md): a fixed cost per loop tick that the
engine's own benches cannot see. The worker therefore
times each part of its tick (`LoopClock.lap`) and publishes the averages per step over the
last full window in `WorkerInfo.loop` (/admin/workers), so a run through the API shows
which part it is. A lap costs one `perf_counter` call.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# what a tick does, in order: writes left from a Redis outage, chores (leases, heartbeat,
# presence, reaper, batches), claims, the forward pass, then waiting for and acting on the
# previous step's writes and sending this one's, ends of failed jobs, and the idle wait
PHASES = ("chores", "claim", "step", "writes", "ends", "idle")
WINDOW_SECONDS = 5.0


class LoopClock:
    """Seconds per phase of the ticks that ran a decode step, over the current window of up
    to `window` seconds and the one before it, so that `summary` always covers the last
    `window` to 2 x `window` seconds. A tick that ran no step (waiting for work, loading,
    the chores of an idle worker) counts whole as idle: the figures are per step."""

    def __init__(
        self, window: float = WINDOW_SECONDS, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.window = window
        self._clock = clock
        self._mark = clock()
        self._current = _Window(self._mark)
        self._previous: _Window | None = None
        self._tick = dict.fromkeys(PHASES, 0.0)  # the tick in progress
        self._stepped = False

    def start_tick(self) -> None:
        now = self._clock()
        self._commit()
        if now - self._current.since >= self.window:
            self._previous, self._current = self._current, _Window(now)
        self._mark = now

    def lap(self, phase: str) -> None:
        """The time since the tick's start or the previous lap was spent in `phase`."""
        now = self._clock()
        self._tick[phase] += now - self._mark
        self._mark = now

    def stepped(self) -> None:
        self._stepped = True

    def _commit(self) -> None:
        window, tick = self._current, self._tick
        if self._stepped:
            window.steps += 1
            for phase, seconds in tick.items():
                window.seconds[phase] += seconds
        else:
            window.seconds["idle"] += sum(tick.values())
        self._tick, self._stepped = dict.fromkeys(PHASES, 0.0), False

    def summary(self) -> dict[str, float]:
        """{"seconds": the span covered, "steps": decode steps in it, "<phase>_ms": ms per
        step (the span's totals where no step ran), "busy": share of the span not idle}."""
        now = self._clock()  # the ticks done: the publishing one is counted at its end
        windows = [w for w in (self._previous, self._current) if w is not None]
        span = max(now - windows[0].since, 1e-9)
        steps = sum(w.steps for w in windows)
        out: dict[str, float] = {"seconds": round(span, 3), "steps": steps}
        for phase in PHASES:
            seconds = sum(w.seconds[phase] for w in windows)
            out[f"{phase}_ms"] = round(seconds * 1000 / max(steps, 1), 3)
        idle = sum(w.seconds["idle"] for w in windows)
        out["busy"] = round(1.0 - min(idle / span, 1.0), 3)
        return out


class _Window:
    def __init__(self, since: float) -> None:
        self.since = since
        self.steps = 0
        self.seconds = dict.fromkeys(PHASES, 0.0)
