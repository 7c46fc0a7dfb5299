"""The per-process snapshot of published and served models (api/directory.py)."""

from __future__ import annotations

import threading
import time

from api import directory as directory_module
from api.directory import Directory, DirectoryCache


def _reads(
    monkeypatch, snapshots: list[Directory], gate: threading.Event | None = None
) -> list[float]:
    """Make `Directory.read` hand out `snapshots` in turn; the times it was called. With a
    `gate`, each read waits until it is set (5 s at most)."""
    calls: list[float] = []

    def read(conn) -> Directory:
        calls.append(time.monotonic())
        if gate is not None:
            gate.wait(5)
        snapshot = snapshots[min(len(calls), len(snapshots)) - 1]
        return Directory(snapshot.models, snapshot.served)  # read_at: now

    monkeypatch.setattr(directory_module.Directory, "read", classmethod(lambda cls, c: read(c)))
    return calls


def _snapshot(*models: str) -> Directory:
    return Directory({m: {} for m in models}, frozenset(models))


def test_a_fresh_snapshot_is_reused_without_a_read(monkeypatch):
    calls = _reads(monkeypatch, [_snapshot("m")])
    cache = DirectoryCache(max_age=60)
    for _ in range(50):
        assert cache.get(None, "m").has("m")
    assert len(calls) == 1


def test_a_model_missing_from_the_snapshot_is_read_again_before_a_refusal(monkeypatch):
    """A worker that came up after the snapshot was read must not be reported absent."""
    calls = _reads(monkeypatch, [_snapshot("m"), _snapshot("m", "new")])
    cache = DirectoryCache(max_age=60)
    assert not cache.get(None, "m").has("new")
    assert cache.get(None, "new").has("new")
    assert len(calls) == 2


def test_a_stale_snapshot_is_served_while_one_thread_reads_the_next(monkeypatch):
    """The refresher's read is held open until the stale answer is in: a `get` that queued
    behind it would return only when the gate's 5 s ran out, after the refresher."""
    gate = threading.Event()
    calls = _reads(monkeypatch, [_snapshot("m"), _snapshot("m"), _snapshot("m")], gate)
    cache = DirectoryCache(max_age=0.05)
    gate.set()
    cache.get(None, "m")  # the first read
    gate.clear()
    time.sleep(0.1)  # now stale
    refresher = threading.Thread(target=cache.get, args=(None, "m"))
    refresher.start()
    deadline = time.monotonic() + 10
    while len(calls) < 2 and time.monotonic() < deadline:  # the refresher is inside its read
        time.sleep(0.01)
    assert cache.get(None, "m").has("m")  # the stale one, at once
    assert refresher.is_alive() and len(calls) == 2
    gate.set()
    refresher.join()
    assert len(calls) == 2
