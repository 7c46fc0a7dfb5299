"""The API under gunicorn as `llmq api` runs it: slow-loris clients (docs/faults.md F15)."""

from __future__ import annotations

import os
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

    deadline = time.monotonic() + 5  # header timeout 2 s in the fixture, silent ones too
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


def _slow_body_socket(url, length: int = 200) -> socket.socket:
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n{" % length
    )
    return sock


def test_slow_bodies_hold_no_thread_and_get_408(gunicorn) -> None:
    """Issue 15: 200 clients trickling their body one byte a second after complete headers
    (more than the process's 32 threads) leave /health answering in < 1 s, and each is
    answered 408 and closed once the body timeout (2 s here) has passed."""
    url = urlparse(gunicorn)
    slow = [_slow_body_socket(url) for _ in range(200)]
    started = time.monotonic()
    probes = []
    while time.monotonic() - started < 1.5:  # within the body timeout: all 200 still open
        for sock in slow:
            sock.send(b" ")
        t0 = time.monotonic()
        assert httpx.get(f"{gunicorn}/health", timeout=5).status_code == 200
        probes.append(time.monotonic() - t0)
        time.sleep(0.3)
    assert max(probes) < 1.0, probes

    answers: dict[socket.socket, bytes] = {}
    while len(answers) < len(slow) and time.monotonic() - started < 8:
        time.sleep(0.5)
        for sock in slow:  # still one byte at a time, until answered
            if sock in answers:
                continue
            try:
                sock.send(b" ")
                sock.setblocking(False)
                answer = sock.recv(200)
            except BlockingIOError:
                continue
            except OSError as exc:
                answer = repr(exc).encode()
            answers[sock] = answer
            sock.close()
    assert len(answers) == len(slow), f"{len(slow) - len(answers)} slow bodies still open"
    assert all(a.startswith(b"HTTP/1.1 408") for a in answers.values()), set(answers.values())
    assert httpx.get(f"{gunicorn}/health", timeout=5).status_code == 200


def test_a_body_that_stops_coming_gets_408_at_the_body_timeout(gunicorn) -> None:
    """Headers and a first byte of the body, then silence: no more bytes come to wake the
    connection, so the worker's own deadline check answers it (2 s here)."""
    url = urlparse(gunicorn)
    sock = _slow_body_socket(url)
    started = time.monotonic()
    sock.settimeout(10)
    answer = sock.recv(200)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert 1.5 < time.monotonic() - started < 4.5


def test_a_new_connection_silent_past_keepalive_is_still_served(
    gunicorn_default_timeouts,
) -> None:
    """A client may connect and send its request seconds later (a burst of 200 threads on
    2 cores: F10). Its connection waits for the header timeout (10 s), not for gunicorn's
    keep-alive timeout (5 s), which closed it before ("Server disconnected")."""
    url = urlparse(gunicorn_default_timeouts)
    sock = socket.create_connection((url.hostname, url.port))
    time.sleep(6.5)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    sock.settimeout(5)
    answer = sock.recv(200)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer


def test_a_body_in_pieces_within_the_timeout_is_served(gunicorn) -> None:
    """The gathered body reaches the app whole: a request whose body comes in three pieces
    0.3 s apart gets its answer (the 404 of an unknown model: the JSON was parsed)."""
    url = urlparse(gunicorn)
    body = b'{"model": "nope", "prompt": "hi", "max_tokens": 2}'
    sock = _slow_body_socket(url, len(body))  # sends the first byte, "{"
    for piece in (body[1:10], body[10:30], body[30:]):
        time.sleep(0.3)
        sock.sendall(piece)
    sock.settimeout(5)
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(4096)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 404"), answer[:200]


@pytest.mark.parametrize(
    ("data", "ready"),
    [
        (b"GET / HTTP/1.1\r\nHost: x\r\n", False),  # headers still coming
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", True),  # no body
        (b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nabc", False),  # body still coming
        (b"POST / HTTP/1.1\r\ncontent-length: 5\r\n\r\nabcde", True),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", True),  # the thread reads
        (b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n", True),
        (b"POST / HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n", True),  # large: 413 fast
        (b"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", True),
    ],
)
def test_which_requests_a_thread_takes_at_once(data: bytes, ready: bool) -> None:
    from api.gunicorn_worker import _ready

    assert _ready(data) is ready


def test_expect_100_continue_is_answered_at_once(gunicorn) -> None:
    """A client that waits for 100 Continue before its body (curl does) is not kept
    waiting for a body it has not sent."""
    url = urlparse(gunicorn)
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-test\r\n"
        b"Content-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"
    )
    sock.settimeout(0.5)
    assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue")
    sock.close()


def _processes_serving(port: int) -> dict[int, int]:
    """pid -> parent pid of every process whose command line binds `port`."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if f"127.0.0.1:{port}".encode() in argv and b"gunicorn" in b" ".join(argv):
            found[int(entry)] = parent
    return found


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_each_api_process_leads_a_session_of_its_own(gunicorn) -> None:
    """api/gunicorn_conf.py post_fork: where CPU shares go by session (Linux autogroups),
    each API process gets one, as each of `llmq serve`'s workers does."""
    port = urlparse(gunicorn).port
    processes = _processes_serving(port)
    workers = [pid for pid, parent in processes.items() if parent in processes]
    assert workers, processes
    master = next(pid for pid in processes if pid not in workers)
    for pid in workers:
        assert os.getsid(pid) == pid != os.getsid(master)
