"""The API under gunicorn as `llmq api` runs it: slow-loris clients (RELIABILITY F15)."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

import httpx
import pytest

pytestmark = pytest.mark.integration


def test_slow_headers_hold_no_thread_and_are_closed(gunicorn) -> None:
    url = urlparse(gunicorn)
    slow = []
    for _ in range(150):  # more than the 32 threads of the single process
        sock = socket.create_connection((url.hostname, url.port))
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        slow.append(sock)
    silent = [socket.create_connection((url.hostname, url.port)) for _ in range(50)]
    time.sleep(0.3)
    for _ in range(10):
        started = time.monotonic()
        assert httpx.get(f"{gunicorn}/health", timeout=5).status_code == 200
        assert time.monotonic() - started < 1.0

    deadline = time.monotonic() + 8  # header timeout 2 s in the fixture; idle close 5 s
    open_socks = slow + silent
    while open_socks:
        assert time.monotonic() < deadline, f"{len(open_socks)} slow sockets still open"
        time.sleep(0.25)
        still = []
        for sock in open_socks:
            try:
                sock.send(b"x") if sock in slow else None  # one byte at a time, forever
                sock.setblocking(False)
                if sock.recv(1) == b"":
                    sock.close()
                    continue
            except BlockingIOError:
                pass
            except OSError:
                sock.close()
                continue
            sock.setblocking(True)
            still.append(sock)
        open_socks = still
    assert httpx.get(f"{gunicorn}/health", timeout=5).status_code == 200
