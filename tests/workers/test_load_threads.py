"""workers/load_threads.py: loads run one after another, each in a thread that is gone
once its load is (a live thread that ran OpenMP work made the worker's decode 2-3x slower;
bench/log/2026-11-27-sixth-session-avx2-epyc.md has the figures), and the pool's loads go
through it."""

from __future__ import annotations

import threading

import pytest

from tests.workers.conftest import wait_for
from workers.load_threads import LoadThreads
from workers.pool import READY, EnginePool, PoolConfig


def _threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_loads_run_in_submission_order_and_no_thread_outlives_its_load() -> None:
    loads = LoadThreads(name="test-load")
    gate, order = threading.Event(), []

    def load(tag: str) -> str:
        gate.wait(5)
        order.append((tag, threading.current_thread()))
        return tag

    futures = [loads.submit(load, tag) for tag in "abc"]
    assert not any(f.done() for f in futures)
    gate.set()
    assert [f.result(5) for f in futures] == ["a", "b", "c"]
    assert [tag for tag, _ in order] == ["a", "b", "c"]
    assert len({thread.ident for _, thread in order}) == 3  # each in a thread of its own
    for _, thread in order:
        thread.join(5)
        assert not thread.is_alive()
    assert _threads_named("test-load") == []


def test_a_failed_load_is_the_future_s_exception_and_the_next_still_runs() -> None:
    loads = LoadThreads(name="test-load")

    def broken() -> None:
        raise ValueError("not a GGUF file")

    failed, fine = loads.submit(broken), loads.submit(lambda: 42)
    with pytest.raises(ValueError, match="not a GGUF"):
        failed.result(5)
    assert fine.result(5) == 42


def test_shutdown_cancels_the_loads_still_waiting_their_turn() -> None:
    loads = LoadThreads(name="test-load")
    gate = threading.Event()
    running = loads.submit(lambda: gate.wait(5))
    waiting = loads.submit(lambda: "never")
    wait_for(running.running, 5, "the first load to start")
    loads.shutdown()
    assert waiting.cancelled()
    with pytest.raises(RuntimeError):
        loads.submit(lambda: None)
    gate.set()
    assert running.result(5) is True  # a load under way finishes
    wait_for(lambda: _threads_named("test-load") == [], 5, "the threads to end")


def test_the_engine_pool_leaves_no_loader_thread_behind_a_loaded_model() -> None:
    seen = []

    def loader(source: str) -> object:
        seen.append(threading.current_thread())
        return type("Engine", (), {"nbytes": 1, "context_length": 8})()

    pool = EnginePool(PoolConfig(), {"a": "a"}, loader)
    entry = pool.request("a")
    pool.wait_loaded(5)
    assert entry.state == READY
    [thread] = seen
    assert thread is not threading.main_thread()
    wait_for(lambda: not thread.is_alive(), 5, "the loader thread to end")
    pool.close()
