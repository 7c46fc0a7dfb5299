"""The submission gate run twice for one job (`api/gate.py`): redis-py's default retry
re-sends a command whose reply was lost (a read timeout, a dropped connection) after the
server has run it, and the API's client keeps that retry for its reads. A second push of
the id would put the job on its queue twice, for two workers to claim. Real Redis."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from api import store
from api.errors import QueueFull
from workers import keys
from workers.wire.broker import NotReplicated, Replication
from workers.wire.job import JobRecord

pytestmark = pytest.mark.integration

MODEL = "tiny"


class LostReply:
    """A client whose every EVALSHA (the gate goes by hash) runs twice on the server and
    answers with the second run, as when the first reply is lost and the retry sends it again."""

    def __init__(self, conn: redis.Redis) -> None:
        self.conn = conn
        self.evals = 0

    def evalsha(self, *args: Any) -> Any:
        self.conn.evalsha(*args)
        self.evals += 1
        return self.conn.evalsha(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


def _job(priority: int = 0) -> JobRecord:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    return JobRecord(store.new_job_id(), "/v1/completions", MODEL, body, priority=priority)


@pytest.mark.parametrize("priority", [0, -3])
def test_a_gate_run_again_for_the_same_job_queues_it_once(real_redis, priority: int) -> None:
    client = LostReply(real_redis)
    record = _job(priority)
    queue = store.enqueue(client, record, max_queue=10)
    assert client.evals == 1  # the gate's script ran twice
    assert real_redis.lrange(f"rq:queue:{queue}", 0, -1) == [record.id.encode()]
    assert int(real_redis.hget(keys.METRIC_JOBS, "queued")) == 1  # counted once
    assert store.get_record(real_redis, record.id).status == "queued"


def test_a_second_job_still_sees_the_first_in_the_depth(real_redis) -> None:
    """Each job's gate is its own: the marker of one never stops another's push, and the
    queue limit still counts every job once."""
    client = LostReply(real_redis)
    first = store.enqueue(client, _job(), max_queue=2)
    second = store.enqueue(client, _job(), max_queue=2)
    assert first == second
    assert real_redis.llen(f"rq:queue:{first}") == 2
    third = _job()
    with pytest.raises(QueueFull, match=r"\(2 jobs waiting\)"):
        store.enqueue(client, third, max_queue=2)
    assert real_redis.llen(f"rq:queue:{first}") == 2
    assert store.get_record(real_redis, third.id) is None  # refused: nothing of it stays


def test_a_redis_that_lost_its_scripts_still_gates_each_job_once(real_redis) -> None:
    """The gate goes by hash (EVALSHA): after a restart or a failover Redis answers
    NOSCRIPT, which ran nothing; the script is loaded and the call sent again, with or
    without the replicas' WAIT behind it in the same pipeline."""
    plain = _job()
    real_redis.script_flush()
    queue = store.enqueue(real_redis, plain, max_queue=10)
    real_redis.script_flush()
    waited = _job()
    with pytest.raises(NotReplicated):  # no replica here confirms: WAIT 1 answers 0
        store.enqueue(real_redis, waited, max_queue=10, replication=Replication(1, 50))
    # both pushed once, in order: the NOSCRIPT reply pushed nothing
    assert real_redis.lrange(f"rq:queue:{queue}", 0, -1) == [
        plain.id.encode(),
        waited.id.encode(),
    ]
