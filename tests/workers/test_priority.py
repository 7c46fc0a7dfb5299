"""workers/priority.py: a worker's threads and its session lowered below the API's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from workers.errors import PriorityError
from workers.priority import (
    NICE_ENV,
    WORKER_NICE,
    autogroups_on,
    lower_session,
    worker_nice,
)

# A child that starts a thread, lowers every thread, starts one more, then prints each
# thread's nice value (the later thread must inherit the lowered value)
CHILD = """
import os, sys, threading
from workers.priority import lower_threads
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()
changed = lower_threads(int(sys.argv[1]))
threading.Thread(target=stop.wait, daemon=True).start()
values = sorted(os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task"))
print(changed, *values)
stop.set()
"""


def run_child(nice: int, under: list[str] | None = None) -> tuple[int, list[int]]:
    """CHILD lowering its threads to `nice` (run under the command `under`, if given): how
    many threads it changed, and each thread's value after."""
    argv = [*(under or []), sys.executable, "-c", CHILD, str(nice)]
    run = subprocess.run(
        argv, capture_output=True, text=True, timeout=30, cwd=Path(__file__).parents[2], check=True
    )
    changed, *values = (int(v) for v in run.stdout.split())
    return changed, values


def test_the_nice_value_comes_from_the_flag_then_the_environment_then_the_default(
    monkeypatch,
) -> None:
    monkeypatch.delenv(NICE_ENV, raising=False)
    assert worker_nice() == WORKER_NICE
    monkeypatch.setenv(NICE_ENV, "3")
    assert worker_nice() == 3
    assert worker_nice(0) == 0
    for wrong in ("20", "-1", "low"):
        with pytest.raises(PriorityError, match=NICE_ENV):
            worker_nice(wrong)


def test_every_thread_is_lowered_and_later_threads_inherit_it() -> None:
    changed, values = run_child(7)
    assert changed == 2  # the main thread and the one started before
    assert values == [7, 7, 7]


def test_lowering_never_raises_a_thread_already_lower() -> None:
    changed, values = run_child(5, under=["nice", "-n", "12"])
    assert changed == 0 and values == [12, 12, 12]


@pytest.mark.skipif(not autogroups_on(), reason="the kernel groups no sessions (no autogroups)")
def test_a_session_of_its_own_is_lowered_as_a_whole() -> None:
    """What `llmq serve` does for each worker's keeper (workers/supervisor.py Child.start):
    the session's autogroup takes the value, and a process it starts afterwards shares it."""
    starts = "import subprocess, sys; sys.stdin.readline(); subprocess.run(['cat', sys.argv[1]])"
    child = subprocess.Popen(
        [sys.executable, "-c", starts, "/proc/self/autogroup"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert lower_session(child.pid, 9)
        started, _ = child.communicate("go\n", timeout=30)  # what its own child reads
    finally:
        child.kill()
        child.wait(10)
    assert started.split()[-1] == "9", started
    # The kernel prints nothing for a process whose CPU group is not an autogroup (a
    # runner's own cgroup, kernel/sched/autogroup.c): then it shares nothing with the child.
    ours = Path("/proc/self/autogroup").read_text().split()
    assert not ours or ours[0] != started.split()[0], (ours, started)
