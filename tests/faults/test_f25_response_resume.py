"""docs/faults.md F25: a background response followed with `starting_after` across a
worker's kill -9 and the API's restart.

A client follows `GET /v1/responses/{id}?stream=true&starting_after=N`, reconnecting after
the last sequence number it saw. Mid-run the worker running the response is killed with
-9 (another takes the job over from its stream), and the whole API (every gunicorn
process) is killed with -9 and started again on another port. Pass: the client's events
are sequence numbers 0..N-1, each once and in order, ending with the terminal event; the
text deltas add up to the finished response's text; and a replay of the whole stream after
the end, from a fresh API process, is exactly what the client saw.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest
import redis

from tests.api.sse import parse
from tests.faults.conftest import MODEL, kill_api
from tests.workers.conftest import wait_for
from workers import keys

pytestmark = [pytest.mark.integration, pytest.mark.faults]

TOKENS = 150  # 40 ms a step: ~6 s of generation, plus the takeover after the kill
TERMINAL = ("response.completed", "response.incomplete", "response.failed")


class ResponseFollower:
    """Follows a response's events on a thread, reconnecting after the last sequence number
    seen to wherever `base[0]` points now."""

    def __init__(self, base: list[str], response_id: str, deadline: float) -> None:
        self.base, self.response_id, self.deadline = base, response_id, deadline
        self.events: list[dict[str, Any]] = []
        self.connections = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def ended(self) -> bool:
        return bool(self.events) and self.events[-1]["type"] in TERMINAL

    def deltas(self) -> int:
        return sum(e["type"] == "response.output_text.delta" for e in self.events)

    def _run(self) -> None:
        while not self.ended and time.monotonic() < self.deadline:
            self._follow_once()
            if not self.ended:
                time.sleep(0.2)

    def _follow_once(self) -> None:
        self.connections += 1
        after = self.events[-1]["sequence_number"] if self.events else -1
        url = f"{self.base[0]}/v1/responses/{self.response_id}"
        params = {"stream": "true", "starting_after": str(after)}
        try:
            with httpx.stream("GET", url, params=params, timeout=10) as reply:
                if reply.status_code != 200:
                    return
                for message in parse(reply.iter_lines()):
                    if message.event is None:
                        continue  # : ping
                    event = message.json()
                    assert event["type"] == message.event != "error", event
                    self.events.append(event)
                    if self.ended:
                        return
        except httpx.TransportError:
            pass


def test_f25_a_background_response_resumes_across_a_worker_kill_and_an_api_restart(
    start_system, start_api
) -> None:
    system = start_system(workers=2, step_delay_ms=40)
    body = {
        "model": MODEL,
        "input": "hello",
        "max_output_tokens": TOKENS,
        "temperature": 0,
        "background": True,
    }
    created = httpx.post(f"{system.api.base}/v1/responses", json=body, timeout=10)
    assert created.status_code == 200, created.text
    response_id = created.json()["id"]
    assert created.json()["status"] == "queued"
    base = [system.api.base]
    follower = ResponseFollower(base, response_id, time.monotonic() + 120)
    wait_for(lambda: follower.deltas() >= 20, 30, "20 text deltas")

    conn = redis.Redis.from_url(system.server.url)
    running_on = conn.hget(keys.job(response_id), "worker").decode()
    victim = next(w for w in system.workers if w.name == running_on)
    victim.kill_tree()
    deltas_at_kill = follower.deltas()
    kill_api(system.api)  # the whole API, while the job waits for another worker
    api = start_api(system.server.url, 1)
    base[0] = api.base
    follower.thread.join(120)

    events = follower.events
    assert follower.ended, events[-3:]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert deltas_at_kill < follower.deltas(), "the response had ended before the kill"
    assert follower.connections >= 2
    final = httpx.get(f"{api.base}/v1/responses/{response_id}", timeout=10).json()
    assert final["status"] in ("completed", "incomplete")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == final["output"][0]["content"][0]["text"]
    assert events[-1]["response"]["output"] == final["output"]
    job = httpx.get(f"{api.base}/v1/jobs/{response_id}", timeout=10).json()
    assert job["attempts"] >= 2  # the kill did cut its first run

    with httpx.stream(
        "GET", f"{api.base}/v1/responses/{response_id}", params={"stream": "true"}, timeout=10
    ) as reply:
        replay = [json.loads(m.data) for m in parse(reply.iter_lines()) if m.event is not None]
    assert replay == events
    assert api.server_errors() == []
    conn.close()
    print(
        f"F25: worker killed at delta {deltas_at_kill}, API killed and restarted; "
        f"{len(events)} events over {follower.connections} connections, "
        f"{follower.deltas()} deltas, {job['attempts']} attempts"
    )
