"""docs/faults.md F4's stress variant (after vLLM's test_request_cancellation): 200 streaming
requests that each hang up after 0.5 s, against gunicorn and one real worker.

Pass: a fresh request completes within 5 s of the last hang-up, no job is still running 5 s
after it, and every job that was created ended `cancelled` (none `finished` its 200
tokens); no 5xx.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import redis

from tests.faults.conftest import MODEL
from tests.workers.conftest import wait_for
from workers import keys

pytestmark = [pytest.mark.integration, pytest.mark.faults]

STREAMS, TOKENS = 200, 200


def test_f4_200_streams_that_hang_up_after_half_a_second(start_system) -> None:
    server, api, _ = start_system(processes=2)
    conn = redis.Redis.from_url(server.url)
    body = {"model": MODEL, "prompt": "cut", "max_tokens": TOKENS, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
    errors: list[str] = []

    def hang_up() -> None:
        try:
            with httpx.stream("POST", f"{api.base}/v1/completions", json=body, timeout=5) as r:
                until = time.monotonic() + 0.5
                for _ in r.iter_lines():
                    if time.monotonic() > until:
                        break
        except httpx.TimeoutException:
            pass  # still waiting for a thread after 5 s: hangs up all the same
        except httpx.TransportError as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=hang_up, daemon=True) for _ in range(STREAMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    gone_at = time.monotonic()

    fresh = httpx.post(
        f"{api.base}/v1/completions",
        json={"model": MODEL, "prompt": "fresh", "max_tokens": 4, "temperature": 0},
        timeout=5,
    )
    fresh_s = time.monotonic() - gone_at
    assert fresh.status_code == 200 and fresh_s < 5, (fresh.status_code, fresh_s)
    wait_for(lambda: conn.scard(keys.RUNNING) == 0, max(0.1, 5 - fresh_s), "no job running")
    settled_s = time.monotonic() - gone_at
    cut = [k for k in conn.scan_iter(keys.job("*")) if conn.type(k) == b"hash"]
    statuses = [conn.hget(k, "status") for k in cut]
    assert b"started" not in statuses and b"queued" not in statuses
    assert statuses.count(b"finished") == 1  # only the fresh request
    assert errors == [], errors[:3]
    assert api.server_errors() == []
    print(
        f"F4 stress: {len(cut) - 1} jobs cancelled; fresh request done {fresh_s:.2f}s after "
        f"the last hang-up; no job running {settled_s:.2f}s after it"
    )
    conn.close()
