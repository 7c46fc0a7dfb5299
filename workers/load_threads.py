"""Model loads, one after another, each in a thread that ends when its load does.

A worker loads models beside its loop (heartbeats and other models' jobs go on), so a load
runs in another thread. That thread must not outlive the load: loading runs OpenMP
parallel regions (torch's and runtime/kernels' packing), and a thread that has run one
keeps its own team of OpenMP threads for as long as it lives. With that second team
alive beside the main thread's, every decode step of the loaded model ran 2-3x slower on
2 cores (SmolLM2: 20-28 tok/s instead of 56-71 in-process, the same with the loader
thread ended; `bench/system.py`'s 1-client row), which a ThreadPoolExecutor's idle thread
caused for the worker's whole life.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class LoadThreads:
    """`submit` runs `fn(*args)` in a new thread once the previous submission's thread
    has ended (submission order); the thread ends with the call."""

    def __init__(self, name: str = "llmq-load") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._last: threading.Thread | None = None
        self._pending: list[Future[Any]] = []
        self._closed = False

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the loader is closed")
            thread = threading.Thread(
                target=self._run, args=(self._last, future, fn, args), name=self.name, daemon=True
            )
            self._last = thread
            self._pending.append(future)
            thread.start()
        return future

    def _run(
        self, previous: threading.Thread | None, future: Future[T], fn: Callable[..., T], args: Any
    ) -> None:
        if previous is not None:
            previous.join()
        with self._lock:
            if future in self._pending:  # not if `shutdown` took the list meanwhile
                self._pending.remove(future)
        if not future.set_running_or_notify_cancel():
            return  # cancelled by `shutdown` while it waited
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # the future carries it to whoever reads the load
            future.set_exception(exc)

    def shutdown(self) -> None:
        """No more submissions; those still waiting for their turn are cancelled (a load
        under way finishes in its daemon thread, as with ThreadPoolExecutor's shutdown)."""
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, []
        for future in pending:
            future.cancel()
