"""docs/faults.md F21: a seeded, sampled job resumed after its worker is killed (F1) must
produce the same tokens as an uninterrupted run of the same request: the resumed attempt's
sampler moves past the tokens sent before it (`SequenceSamplingState.replay`: one uniform
per draw, as `runtime.sampling._draw` takes, and the penalty counts).
"""

from __future__ import annotations

import pytest
import redis

from tests.faults.conftest import submit_async, wait_ready, wait_terminal
from tests.workers.conftest import stream, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.faults]

TOKENS = 120
SAMPLED = {"temperature": 1.0, "seed": 1234}


def _token_ids(conn: redis.Redis, job_id: str) -> list[int]:
    return [d["token_id"] for kind, d in stream(conn, job_id) if kind == "token"]


def test_a_seeded_sampled_job_resumed_after_a_kill_repeats_the_uninterrupted_run(
    fault_redis, start_api, start_workers
) -> None:
    server = fault_redis(persistent=False)
    api = start_api(server.url)
    conn = redis.Redis.from_url(server.url)
    [victim] = start_workers(server.url, step_delay_ms=40)
    wait_ready(api)
    cut = submit_async(api.base, TOKENS, prompt="a seeded tale", **SAMPLED)
    wait_for(lambda: len(_token_ids(conn, cut)) >= 30, 30, "30 tokens before the kill")
    victim.kill_tree()
    [rescuer] = start_workers(server.url, step_delay_ms=0)
    assert wait_terminal(api.base, cut, 60)["attempts"] == 2
    whole = submit_async(api.base, TOKENS, prompt="a seeded tale", **SAMPLED)
    assert wait_terminal(api.base, whole, 60)["attempts"] == 1
    rescuer.assert_alive()
    assert _token_ids(conn, cut) == _token_ids(conn, whole)
    conn.close()
