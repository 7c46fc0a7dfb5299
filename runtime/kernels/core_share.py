"""How many of this machine's cores torch's kernels may use, given what else runs on them.

torch's OpenMP threads meet at a barrier after every kernel, and a thread waiting there
spins. With as many threads as cores and one other runnable process (the API, Redis, a
second worker, anyone's busy loop), one of our threads is always descheduled while its
partner spins for it: a decode step went from ~30 ms to ~1 s (bench/RESULTS.md, "Sharing
the cores"). One thread fewer than the busy cores leaves nothing to wait for. Spinning
is what makes a quiet machine fast, so the wait policy stays; the thread count follows
the load instead.

The load is sampled from /proc: runnable tasks machine-wide (`procs_running` in
/proc/stat) less this process's own runnable threads. A sample costs ~0.1 ms and is taken
at most every `SAMPLE_SECONDS`; the count changes only when a whole window of samples
agrees, so a Redis command that happens to run during one sample does not move it.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

SAMPLE_SECONDS = 0.05
WINDOW = 6  # samples that must agree before the thread count moves (~0.3 s)


def runnable_elsewhere() -> int | None:
    """Tasks ready to run on this machine that are not this process's threads (None where
    /proc does not tell: not Linux)."""
    try:
        stat = Path("/proc/stat").read_text()
    except OSError:
        return None
    running = next(
        (int(line.split()[1]) for line in stat.splitlines() if line.startswith("procs_running")),
        None,
    )
    if running is None:
        return None
    own = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            # the state follows the command name's closing parenthesis
            if (task / "stat").read_text().rsplit(")", 1)[1].split()[0] == "R":
                own += 1
        except (OSError, IndexError):  # a thread that ended between listing and reading
            continue
    return max(0, running - own)


class CoreShare:
    """Keeps torch's thread count at the cores nobody else is using, never below one."""

    def __init__(
        self,
        cores: int,
        set_threads: Callable[[int], None],
        probe: Callable[[], int | None] = runnable_elsewhere,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cores = cores
        self.threads = cores
        self._set_threads, self._probe, self._clock = set_threads, probe, clock
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
        _shared = CoreShare(cores, set_threads, probe=(lambda: 0) if fixed else runnable_elsewhere)
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
