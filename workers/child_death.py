"""A keeper between `llmq serve` and each process it starts, so that the process dies with
serve however serve ends (kill -9, the OOM killer, a crash), grandchildren included.

serve runs `python -I -S child_death.py [options] -- ARGV` (`keeper_argv`) in a session of
its own; the keeper forks ARGV into a process group of its own (the child's group: gunicorn's
worker processes and RQ's scheduler process stay in it) and then:

- forwards SIGTERM, SIGINT, SIGHUP and SIGQUIT from serve to that group, and if the child has
  not exited `--grace` seconds after a stop signal, SIGKILLs the group (serve's own escalation
  reached only the child: gunicorn's workers and RQ's scheduler outlived it);
- watches serve itself: a pidfd of its parent (Linux 5.3+, no matter which thread of serve
  started it, unlike PR_SET_PDEATHSIG, which fires when the forking *thread* exits), else
  getppid() polled every half second (any POSIX). When serve is gone it sends the group
  SIGTERM (again `--again` seconds later, if set), and SIGKILL after `--orphan-grace`;
- sets PR_SET_PDEATHSIG(SIGKILL) in the child before exec (the keeper has one thread, so the
  thread caveat does not apply), so a kill -9 of the keeper itself takes the child with it;
- when the child exits, SIGKILLs whatever it left in its group, and exits as the child did
  (same code, or the same signal), so serve's restart logic and messages are unchanged.

SIGTERM first for everyone because each of serve's children stops cleanly on it: the broker
writes and fsyncs its append-only file (redis-server handles SIGTERM as SHUTDOWN), gunicorn
stops its worker processes, a worker hands its running jobs back. SIGKILL after a grace
because the workers and the webhook sender are built to be killed (leases, outbox: see
docs/faults.md F1 and F24), and a process whose supervisor is gone must not linger.

Runs on the standard library only, under `-I -S` (no site-packages: it starts in ~20 ms).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time
from pathlib import Path

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_POLL_SECONDS = 0.5  # where no pidfd tells the keeper that serve is gone
SCRIPT = Path(__file__).resolve()


def keeper_argv(
    argv: list[str],
    *,
    grace: float,
    orphan_grace: float,
    again: float = 0.0,
    python: str = sys.executable,
) -> list[str]:
    """The command line that runs `argv` under a keeper (start it with
    start_new_session=True: the keeper leads a session of its own)."""
    options = ["--grace", f"{grace:g}", "--orphan-grace", f"{orphan_grace:g}"]
    if again:
        options += ["--again", f"{again:g}"]
    return [python, "-I", "-S", str(SCRIPT), *options, "--", *argv]


def set_parent_death_signal(sig: int) -> None:
    """PR_SET_PDEATHSIG on Linux; nothing elsewhere (the keeper's watch still works)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def pidfd(pid: int) -> int | None:
    """A file descriptor that becomes readable when `pid` exits; None where unsupported."""
    if not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


def spawn(argv: list[str]) -> int:
    """Fork `argv` into a process group of its own. Stop signals are blocked across the fork
    so one that arrives meanwhile is not lost: the child takes it with default handling."""
    keeper = os.getpid()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            for sig in FORWARDED:
                signal.signal(sig, signal.SIG_DFL)
            set_parent_death_signal(signal.SIGKILL)
            if os.getppid() != keeper:  # the keeper died before prctl: follow it
                os._exit(128 + signal.SIGKILL)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            os.execvp(argv[0], argv)
        except BaseException as exc:  # noqa: BLE001 - the child must never return into here
            try:
                os.write(2, f"llmq keeper: cannot run {argv[0]}: {exc}\n".encode())
            finally:
                os._exit(127)
    try:
        os.setpgid(pid, pid)  # here too, so that no signal to the group can come first
    except OSError:
        pass  # the child has set it and already exec'd
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return pid


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def exit_as(status: int) -> None:
    """End this process as the child ended: its exit code, or killed by its signal."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal whose default is not to terminate
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def ended(pid: int) -> bool:
    """The child has exited; it stays a zombie (WNOWAIT), so its pid, and so its group's
    id, cannot be taken by another process while its group is swept."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def keep(argv: list[str], grace: float, orphan_grace: float, again: float) -> None:
    parent = os.getppid()
    parent_fd = pidfd(parent)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    requested: list[int] = []
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: requested.append(signum))
    child = spawn(argv)
    child_fd = pidfd(child)
    kill_at: float | None = None  # SIGKILL the group then, if the child still runs
    again_at: float | None = None
    orphaned = False
    while True:
        now = time.monotonic()
        waits = [t - now for t in (kill_at, again_at) if t is not None]
        watch_parent = None if orphaned else parent_fd  # once gone, it stays readable
        if child_fd is None or (parent_fd is None and not orphaned):
            waits.append(PARENT_POLL_SECONDS)
        fds = [fd for fd in (wake_r, watch_parent, child_fd) if fd is not None]
        select.select(fds, [], [], max(0.0, min(waits)) if waits else None)
        try:
            while os.read(wake_r, 512):
                pass
        except BlockingIOError:
            pass
        if ended(child):
            signal_group(child, signal.SIGKILL)  # what it left behind
            _, status = os.waitpid(child, 0)
            exit_as(status)
        now = time.monotonic()
        while requested:
            sig = requested.pop(0)
            signal_group(child, sig)
            if kill_at is None:
                kill_at = now + grace
        if not orphaned and os.getppid() != parent:  # reparented: serve is gone
            orphaned = True
            signal_group(child, signal.SIGTERM)
            kill_at = min(kill_at or float("inf"), now + orphan_grace)
            again_at = now + again if again else None
        if again_at is not None and now >= again_at:
            again_at = None
            signal_group(child, signal.SIGTERM)
        if kill_at is not None and now >= kill_at:
            kill_at = None
            signal_group(child, signal.SIGKILL)


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="child_death.py", description=__doc__.split("\n")[0])
    parser.add_argument("--grace", type=float, required=True)
    parser.add_argument("--orphan-grace", type=float, required=True)
    parser.add_argument("--again", type=float, default=0.0)
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    opts = parser.parse_args(args)
    argv = opts.argv[1:] if opts.argv[:1] == ["--"] else opts.argv
    if not argv:
        parser.error("nothing to run")
    keep(argv, opts.grace, opts.orphan_grace, opts.again)


if __name__ == "__main__":
    main()
