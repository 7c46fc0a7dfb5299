"""Prefix-affinity routing, the API's half: `prefix_digest`, and which queue `enqueue` picks
(fakeredis; the workers' half runs on real Redis in tests/workers/test_affinity.py)."""

from __future__ import annotations

import fakeredis
import pytest
from rq.job import Job
from rq.serializers import JSONSerializer

from api import store
from api.errors import QueueFull
from workers import keys
from workers.wire.defaults import AFFINITY_MAX_QUEUED, WAKE_MAX_TOKENS, WAKE_TTL_SECONDS
from workers.wire.job import CANCELLED, CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS, JobRecord
from workers.wire.prefix import continuation_digest, prefix_digest
from workers.wire.worker_info import WorkerInfo

SYSTEM = "You are a careful assistant. " * 12  # ~350 characters: worth routing
MODEL = "tiny"


def chat(system: str, *turns: str) -> dict:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": MODEL, "messages": messages}


def test_chat_digest_is_the_system_prompt_and_history_not_the_last_question():
    first = prefix_digest(CHAT_COMPLETIONS, chat(SYSTEM, "What is 2+2?"))
    assert first is not None and len(first) == 32
    assert prefix_digest(CHAT_COMPLETIONS, chat(SYSTEM, "Name a colour.")) == first
    assert prefix_digest(CHAT_COMPLETIONS, chat(SYSTEM + "!", "What is 2+2?")) != first
    assert prefix_digest(COMPLETIONS, {"prompt": SYSTEM}) != first  # endpoints never mix
    later_turn = chat(SYSTEM, "What is 2+2?", "4", "And 3+3?")
    assert prefix_digest(CHAT_COMPLETIONS, later_turn) not in (None, first)


def test_the_next_turn_of_a_conversation_has_the_digest_its_worker_recorded():
    request = chat(SYSTEM, "What is 2+2?")
    recorded = continuation_digest(CHAT_COMPLETIONS, request, "4")
    next_turn = chat(SYSTEM, "What is 2+2?", "4", "And 3+3?")
    assert recorded == prefix_digest(CHAT_COMPLETIONS, next_turn)
    assert continuation_digest(COMPLETIONS, {"prompt": SYSTEM}, "4") is None


def test_one_message_and_completions_use_the_head_of_the_prompt():
    document = "A long shared document. " * 80  # ~1,900 characters
    one = {"messages": [{"role": "user", "content": document + "Summarise it."}]}
    other = {"messages": [{"role": "user", "content": document + "Translate it."}]}
    assert prefix_digest(CHAT_COMPLETIONS, one) == prefix_digest(CHAT_COMPLETIONS, other)
    head = prefix_digest(COMPLETIONS, {"prompt": document + "Q1"})
    assert head is not None and head == prefix_digest(COMPLETIONS, {"prompt": document + "Q2"})


@pytest.mark.parametrize(
    ("endpoint", "request_"),
    [
        (CHAT_COMPLETIONS, chat("Be brief.", "Hi")),  # a short prefix: routing does not pay
        (COMPLETIONS, {"prompt": "short"}),
        (COMPLETIONS, {"prompt": [SYSTEM, SYSTEM]}),
        (EMBEDDINGS, {"input": SYSTEM}),
        (CHAT_COMPLETIONS, {"messages": "not a list"}),
    ],
)
def test_no_digest_where_routing_does_not_pay(endpoint, request_):
    assert prefix_digest(endpoint, request_) is None


def test_queue_names_of_a_workers_own_queue():
    own = keys.personal_queue_name(MODEL, "host.42")
    assert own == "llmq-tiny-interactive@host.42"
    assert keys.parse_queue_name(own) == (MODEL, keys.INTERACTIVE)
    assert keys.queue_owner(own) == "host.42" and keys.queue_owner(keys.queue_name(MODEL)) is None
    assert keys.shared_queue_name(own) == keys.queue_name(MODEL)
    with pytest.raises(ValueError):
        keys.parse_queue_name("llmq-tiny-interactive@")


# ---------------------------------------------------------------- enqueue's choice


def holder(conn: fakeredis.FakeRedis, name: str = "a", **kw) -> str:
    """A live worker hash that says `name` serves its own queue, and an affinity entry naming
    it for SYSTEM; the name of its own queue."""
    own = keys.personal_queue_name(MODEL, name)
    info = WorkerInfo(name=name, queues=[own, keys.queue_name(MODEL)], **kw)
    conn.hset(keys.worker(name), mapping=info.to_hash())
    digest = prefix_digest(CHAT_COMPLETIONS, chat(SYSTEM, "q"))
    conn.set(keys.affinity(MODEL, digest), name)
    return own


def enqueue(conn: fakeredis.FakeRedis, request: dict, max_queue: int = 0) -> tuple[str, str]:
    record = JobRecord(store.new_job_id(), CHAT_COMPLETIONS, MODEL, request)
    return record.id, store.enqueue(conn, record, max_queue)


def test_a_job_goes_to_the_worker_holding_its_prefix_until_its_queue_is_full(fake_redis):
    own = holder(fake_redis, max_sequences=8)
    jobs = [enqueue(fake_redis, chat(SYSTEM, f"question {i}")) for i in range(6)]
    assert [name for _, name in jobs] == [own] * AFFINITY_MAX_QUEUED + [keys.queue_name(MODEL)] * 2
    assert fake_redis.lrange(f"rq:queue:{own}", 0, -1) == [j.encode() for j, _ in jobs[:4]]
    assert fake_redis.llen(f"rq:queue:{keys.queue_name(MODEL)}") == 2
    for job_id, _ in jobs:  # for RQ, every one is a job of the shared queue
        origin = Job.fetch(job_id, connection=fake_redis, serializer=JSONSerializer).origin
        assert origin == keys.queue_name(MODEL)
    other = enqueue(fake_redis, chat("Another system prompt. " * 20, "q"))[1]
    assert other == keys.queue_name(MODEL)  # another prefix: the shared queue


def test_a_busy_worker_gets_no_more_than_its_batch_has_room_for(fake_redis):
    own = holder(fake_redis, max_sequences=2, current_jobs=["j1"])
    names = [enqueue(fake_redis, chat(SYSTEM, f"question {i}"))[1] for i in range(2)]
    assert names == [own, keys.queue_name(MODEL)]


@pytest.mark.parametrize(
    "change",
    [{"state": "stopping"}, {"heartbeat": "0"}, {"queues": "[]"}],
    ids=["draining", "dead", "no-longer-serving-it"],
)
def test_a_holder_that_would_not_run_the_job_gets_nothing(fake_redis, change):
    holder(fake_redis)
    fake_redis.hset(keys.worker("a"), mapping=change)
    assert enqueue(fake_redis, chat(SYSTEM, "q"))[1] == keys.queue_name(MODEL)


def test_the_depth_limit_counts_the_workers_own_queues(fake_redis):
    own = holder(fake_redis)
    for i in range(2):
        assert enqueue(fake_redis, chat(SYSTEM, f"q{i}"), max_queue=3)[1] == own
    enqueue(fake_redis, chat("Other. " * 40, "q"), max_queue=3)
    with pytest.raises(QueueFull):
        enqueue(fake_redis, chat(SYSTEM, "one too many"), max_queue=3)


def test_a_job_waiting_on_a_workers_own_queue_is_cancelled_there(fake_redis):
    own = holder(fake_redis)
    job_id, name = enqueue(fake_redis, chat(SYSTEM, "q"))
    assert name == own
    store.cancel(fake_redis, job_id)
    assert fake_redis.llen(f"rq:queue:{own}") == 0
    assert store.get_record(fake_redis, job_id).status == CANCELLED


def test_each_job_wakes_the_queue_it_waits_on_in_the_same_transaction(fake_redis):
    own = holder(fake_redis)
    shared = keys.queue_name(MODEL)
    assert enqueue(fake_redis, chat(SYSTEM, "q"))[1] == own
    assert fake_redis.llen(keys.queue_wake(own)) == 1
    assert not fake_redis.exists(keys.queue_wake(shared))
    for i in range(2 * WAKE_MAX_TOKENS):
        assert enqueue(fake_redis, chat(f"Another system prompt {i}. " * 20, "q"))[1] == shared
    assert fake_redis.llen(keys.queue_wake(shared)) == WAKE_MAX_TOKENS  # bounded
    for name in (own, shared):
        assert 0 < fake_redis.ttl(keys.queue_wake(name)) <= WAKE_TTL_SECONDS
