"""How much of a busy machine's CPU a worker takes beside the API and the broker.

A worker's decode step wants every core it can get; the API's work per request is small and
a client waits on it (an acknowledgement, a stream's headers). On a machine they share, the
kernel's scheduler splits the cores by weight, and equal weights hand a decoding worker as
much as an API process. `llmq serve --worker-nice N` (`LLMQ_WORKER_NICE`) starts its workers
at a lower priority: an idle API costs them nothing, and a busy one goes first.

It is off by default (`WORKER_NICE` 0) because a nice worker yields to every other process
on the machine, not only to the API. Measured with `make test-load` on the shared 2-core
Zen 4 (others' work holding 33-61% of the cores; two runs each way, interleaved): at nice 10
the API's p99 was 480-484 ms against 531-639 ms, its threads waited for a core 1.2-1.8x
their CPU time against 2.1-2.4x, and the slowest stream headers 5.2-5.4 s against
14.4-15.2 s; but the workers got 31-40 CPU seconds against 50-54 and completed 1,304-1,505
streams against 3,033-3,095. Where llmq has the machine to itself the workers yield only to
the API and the broker; that was not measured here.

Two levers, because Linux has two levels of sharing. Each thread's nice value weighs it
against the threads of its own scheduling group. With autogroups on (/proc/sys/kernel/
sched_autogroup_enabled, the default of many distributions) every session is such a group
and the groups share the CPU first, by the group's own nice value: `llmq serve` starts each
child in a session of its own (workers/supervisor.py), so a worker's thread nice alone
weighs it against nothing but its keeper, and only the session's nice (/proc/PID/autogroup)
reaches the API's sessions. Without autogroups (a container, a systemd service's cgroup)
the threads' nice values are what counts. Raising either needs no privilege; lowering
them again does.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

from workers.errors import PriorityError

log = logging.getLogger("llmq.priority")

WORKER_NICE = 0  # `llmq serve`'s workers: as the API (10 would weigh one ~1/9 of it, 110:1024)
NICE_ENV = "LLMQ_WORKER_NICE"
NICE_RANGE = range(0, 20)  # 0: as the API; 19: the lowest
AUTOGROUP_ENABLED = Path("/proc/sys/kernel/sched_autogroup_enabled")
# the kernel takes one autogroup change per 100 ms from an unprivileged process (EAGAIN)
AUTOGROUP_RETRY_SECONDS = 0.11
AUTOGROUP_TRIES = 20


def worker_nice(value: str | int | None = None) -> int:
    """`value`, else `LLMQ_WORKER_NICE`, else `WORKER_NICE`; refused outside 0-19."""
    if value is None or value == "":
        value = os.environ.get(NICE_ENV) or WORKER_NICE
    try:
        nice = int(value)
    except ValueError:
        raise PriorityError(
            f"a worker's nice value (--nice, {NICE_ENV}) is a whole number from 0 to 19, "
            f"got {value!r}"
        ) from None
    if nice not in NICE_RANGE:
        raise PriorityError(
            f"a worker's nice value (--nice, {NICE_ENV}) is from 0 to 19, got {nice}"
        )
    return nice


def lower_threads(nice: int) -> int:
    """Set every thread of this process to at least `nice` (Linux's setpriority acts on one
    thread; threads started afterwards inherit the caller's). Returns the threads changed."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]  # no /proc: the calling thread, which the engine's threads inherit from
    changed = 0
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except OSError:
            continue  # a thread that ended meanwhile
    return changed


def autogroups_on(flag: Path = AUTOGROUP_ENABLED) -> bool:
    try:
        return flag.read_text().strip() == "1"
    except OSError:
        return False


def lower_session(pid: int, nice: int) -> bool:
    """Set the autogroup (the session) of process `pid` to `nice`: call it only for a
    process that leads a session made for it, since every process of the session shares
    the value. False where the kernel has no autogroups or refuses (logged)."""
    if not autogroups_on():
        return False
    path = Path(f"/proc/{pid}/autogroup")
    for _ in range(AUTOGROUP_TRIES):
        try:
            path.write_text(str(nice))
            return True
        except OSError as exc:
            if exc.errno != errno.EAGAIN:
                log.warning("could not lower the priority of process %d's session: %s", pid, exc)
                return False
            time.sleep(AUTOGROUP_RETRY_SECONDS)
    log.warning("could not lower the priority of process %d's session: kernel busy", pid)
    return False
