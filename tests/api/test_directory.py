"""The per-process snapshot of published and served models (api/directory.py)."""

from __future__ import annotations

import threading
import time

from api import directory as directory_module
from api.directory import Directory, DirectoryCache


def _reads(monkeypatch, snapshots: list[Directory], delay: float = 0.0) -> list[float]:
    """Make `Directory.read` hand out `snapshots` in turn; the times it was called."""
    calls: list[float] = []

    def read(conn) -> Directory:
        calls.append(time.monotonic())
        time.sleep(delay)
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
    calls = _reads(monkeypatch, [_snapshot("m"), _snapshot("m"), _snapshot("m")], delay=0.3)
    cache = DirectoryCache(max_age=0.05)
    cache.get(None, "m")  # the first read
    time.sleep(0.1)  # now stale
    refresher = threading.Thread(target=cache.get, args=(None, "m"))
    refresher.start()
    time.sleep(0.05)  # the refresher is inside its 0.3 s read
    started = time.monotonic()
    assert cache.get(None, "m").has("m")  # the stale one, at once
    assert time.monotonic() - started < 0.1
    refresher.join()
    assert len(calls) == 2
