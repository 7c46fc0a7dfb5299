"""What an earlier `llmq serve` left running, found and stopped before a new one starts.

Its keepers (workers/child_death.py) stop every process of a serve that died, within their
orphan grace; this is for whatever outlived them anyway (a keeper killed too, a serve of a
version without keepers): an API still holding the port ("address already in use"), workers,
and above all a broker still writing the append-only file the new broker is about to open.

Found through Linux's /proc, among this user's processes only (elsewhere nothing is found):

- processes whose environment carries `SERVED_BY_ENV` = the serve's folder: serve sets it in
  every child's environment, and their children inherit it. Only an llmq serve of that folder
  sets that value, and the caller holds that folder's lock, so no live serve owns them;
- a redis-server whose working directory is the broker's data folder (redis-server chdirs to
  its `--dir`, and rewrites its own environment for its process title, so the marker is gone
  there): no other server may write that folder's append-only file.

Each gets SIGTERM (redis-server handles it as SHUTDOWN: its append-only file is written and
fsynced before it exits), then SIGKILL if it has not gone after the grace.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("llmq.serve")

SERVED_BY_ENV = "LLMQ_SERVED_BY"  # in every process llmq serve starts: the serve's folder
PROC = Path("/proc")
POLL_SECONDS = 0.05


def _own_pids() -> Iterable[int]:
    if not PROC.is_dir():
        return
    uid = os.getuid()
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    yield int(entry.name)
            except OSError:
                continue


def marked(value: str) -> list[int]:
    """This user's live processes whose environment has SERVED_BY_ENV=value (not this one)."""
    needle = f"{SERVED_BY_ENV}={value}".encode()
    found = []
    for pid in _own_pids():
        if pid == os.getpid():
            continue
        try:
            environ = (PROC / str(pid) / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and running(pid):
            found.append(pid)
    return found


def redis_servers_in(directory: Path) -> list[int]:
    """This user's live redis-server processes working in `directory`."""
    target = directory.resolve()
    found = []
    for pid in _own_pids():
        try:
            # its name, not its binary's: Debian's redis-server links to redis-check-rdb
            name = (PROC / str(pid) / "comm").read_text().strip()
            cwd = Path(os.readlink(PROC / str(pid) / "cwd"))
        except OSError:
            continue
        if name == "redis-server" and cwd == target and running(pid):
            found.append(pid)
    return found


def running(pid: int) -> bool:
    """Alive and not a zombie (a zombie is dead; only its parent's wait is missing)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def stop(pids: list[int], grace: float, what: str) -> None:
    """SIGTERM each, SIGKILL those still running after `grace` seconds; returns once all are
    gone. A pid is signalled only while it still runs the process that was found: between
    the scan and here a pid can end but not be reused by an unrelated process so fast that
    it matters (Linux hands out pids in order)."""
    if not pids:
        return
    log.warning("stopping %s left by an llmq serve that died: pids %s", what, pids)
    _signal(pids, signal.SIGTERM)
    if _wait_gone(pids, grace):
        return
    left = [pid for pid in pids if running(pid)]
    log.warning("%s still running %gs after SIGTERM: killing pids %s", what, grace, left)
    _signal(left, signal.SIGKILL)
    _wait_gone(left, 10.0)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _wait_gone(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(running(pid) for pid in pids):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True
