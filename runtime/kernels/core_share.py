"""How many of this machine's cores torch's kernels may use, given what else runs on them.

torch's OpenMP threads meet at a barrier after every kernel, and a thread waiting there
spins. With as many threads as cores and one other busy process (the API, Redis, a
second worker, anyone's busy loop), one of our threads is always descheduled while its
partner spins for it: a decode step went from ~30 ms to ~1 s ("Threads" in
bench/log/2026-11-23-kernel-layer-avx2-epyc.md). One thread fewer than the busy cores leaves
nothing to wait for. Spinning
is what makes a quiet machine fast, so the wait policy stays; the thread count follows
the load instead.

The load is the CPU time other processes used over the last `SPAN_SECONDS`: the machine's
busy time in /proc/stat less this process's own (`time.process_time`), in cores. A count
of runnable tasks at the moment of sampling misled it: the worker samples just after it
writes a step's tokens, which is when the API's threads, Redis and the clients wake to
relay them, so at 32 streams it saw 7-36 tasks "elsewhere" on most samples and ran on one
thread while they used 0.1 of a core (bench/log/2026-11-24-third-session-avx512-epyc.md).
A sample costs ~0.05 ms and is taken at most every `SAMPLE_SECONDS`; the count changes only
when a whole window of samples agrees.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

SAMPLE_SECONDS = 0.05
WINDOW = 6  # samples that must agree before the thread count moves (~0.3 s)
SPAN_SECONDS = 0.5  # the trailing time over which other processes' CPU use is averaged
# /proc/stat's cpu line: user nice system idle iowait irq softirq steal ...
_BUSY_FIELDS = (0, 1, 2, 5, 6)


def machine_busy_seconds(stat: str | None = None) -> float | None:
    """CPU seconds the whole machine has spent busy since boot (user, nice, system, irq,
    softirq; not idle, iowait or steal), from /proc/stat; None where it does not tell."""
    try:
        text = Path("/proc/stat").read_text() if stat is None else stat
        fields = [int(v) for v in text.split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 7:
        return None
    return sum(fields[i] for i in _BUSY_FIELDS) / os.sysconf("SC_CLK_TCK")


class CpuElsewhere:
    """The probe: cores' worth of CPU time that processes other than this one used over the
    last `span` seconds, rounded (None until a sample at least half a span old exists, or
    where /proc does not tell)."""

    def __init__(
        self,
        busy: Callable[[], float | None] = machine_busy_seconds,
        own: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        span: float = SPAN_SECONDS,
    ) -> None:
        self._busy, self._own, self._clock, self.span = busy, own, clock, span
        self._history: deque[tuple[float, float, float]] = deque()

    def __call__(self) -> int | None:
        busy = self._busy()
        if busy is None:
            return None
        now, own = self._clock(), self._own()
        self._history.append((now, busy, own))
        while len(self._history) > 2 and now - self._history[1][0] >= self.span:
            self._history.popleft()  # keep the newest sample at least a span old
        then, busy_then, own_then = self._history[0]
        if now - then < self.span / 2:
            return None
        others = ((busy - busy_then) - (own - own_then)) / (now - then)
        return max(0, int(others + 0.5))


class CoreShare:
    """Keeps torch's thread count at the cores nobody else is using, never below one."""

    def __init__(
        self,
        cores: int,
        set_threads: Callable[[int], None],
        probe: Callable[[], int | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cores = cores
        self.threads = cores
        self._set_threads, self._clock = set_threads, clock
        self._probe = probe if probe is not None else CpuElsewhere()
        self._samples: deque[int] = deque(maxlen=WINDOW)
        self._next_sample = -float("inf")
        self.changes = 0  # how often the count moved (benches print it)

    def adjust(self) -> int:
        """Called before each forward pass; the thread count to run it with."""
        now = self._clock()
        if now < self._next_sample:
            return self.threads
        self._next_sample = now + SAMPLE_SECONDS
        others = self._probe()
        if others is None:
            return self.threads
        self._samples.append(max(1, self.cores - others))
        if len(self._samples) == WINDOW and len(set(self._samples)) == 1:
            wanted = self._samples[0]
            if wanted != self.threads:
                self.threads = wanted
                self.changes += 1
                self._set_threads(wanted)
        return self.threads


_shared: CoreShare | None = None


def share_cores(cores: int, set_threads: Callable[[int], None]) -> CoreShare:
    """The process's one `CoreShare` (torch's thread count is process-wide); the first
    backend to ask sets it up. `LLMQ_FIXED_THREADS=1` keeps the count at `cores`."""
    global _shared
    if _shared is None:
        fixed = os.environ.get("LLMQ_FIXED_THREADS", "") not in ("", "0")
        _shared = CoreShare(cores, set_threads, probe=(lambda: 0) if fixed else None)
    return _shared


def threads() -> int:
    """Threads for the engine's own parallel kernels (runtime/kernels/native.py): torch's
    count where a torch backend shares the cores, else one."""
    return _shared.threads if _shared is not None else 1


def before_forward_pass() -> None:
    """What a generator calls before each step: a no-op unless a torch backend shares the
    cores."""
    if _shared is not None:
        _shared.adjust()
