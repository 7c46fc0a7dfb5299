"""A disk made slow on purpose: a thread that rewrites a file and fsyncs it, over and over,
in the folder a broker keeps its append-only file in, so that the broker's own fsyncs
queue behind it as they do on a machine loading models or writing checkpoints.

Bounded: the file is rewritten in place (`chunks` x `chunk_bytes`, 64 MiB by default), and
the thread stops on `stop()`, on leaving the `with` block, or after `max_seconds` whatever
happens to its owner. Used by tests/workers/test_redis_server.py and
bench/embedded_broker.py.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import TracebackType


class BusyDisk:
    """`with BusyDisk(folder) as disk:` keeps the disk under `folder` busy inside the block;
    `disk.fsyncs` counts the fsyncs it finished and `disk.slowest` is the longest one (s)."""

    def __init__(
        self,
        folder: Path,
        chunk_bytes: int = 4 << 20,
        chunks: int = 16,
        max_seconds: float = 300.0,
    ) -> None:
        self.path = Path(folder) / "busy-disk.bin"
        self.chunk = os.urandom(chunk_bytes)
        self.chunks = chunks
        self.max_seconds = max_seconds
        self.fsyncs = 0
        self.slowest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy-disk", daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                os.lseek(fd, 0, os.SEEK_SET)
                for _ in range(self.chunks):
                    os.write(fd, self.chunk)
                started = time.monotonic()
                os.fsync(fd)
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.fsyncs += 1
        finally:
            os.close(fd)
            self.path.unlink(missing_ok=True)

    def start(self) -> BusyDisk:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> BusyDisk:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()
