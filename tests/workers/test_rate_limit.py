"""The rate-limit buckets' scripts (`workers.wire.rate_limit`) and the settling of a job's
reservation by its final write (`workers.scripts.append`), against real Redis.

Where a test reads a bucket's remaining figures exactly, its limits are small enough that one
unit comes back only after seconds: a stall between two calls on a busy machine (beside two
busy loops, tens of ms) then refills nothing. With 6,000 tokens a minute, one token every
10 ms, the settling tests failed there every time."""

from __future__ import annotations

import dataclasses
import time

import pytest

from tests.workers.conftest import TINY, submit
from workers import keys, scripts
from workers.event_store import RedisEvents
from workers.event_writer import EventWriter
from workers.wire import rate_limit
from workers.wire.job import COMPLETIONS, JobRecord
from workers.wire.rate_limit import REQUESTS, TOKENS, WINDOW_MS, Reservation

pytestmark = pytest.mark.integration

A, B = keys.rate_limit("key:a"), keys.rate_limit("key:b")
QUEUES = [f"rq:queue:{keys.queue_name(TINY)}"]


def figures(charged: rate_limit.Charge) -> dict[str, tuple[int, int]]:
    """bucket name -> (limit, remaining)."""
    return {b.name: (b.limit, b.remaining) for b in charged.buckets}


def look(conn, bucket: str, limits: tuple[int, int]) -> rate_limit.Charge:
    return rate_limit.charge(conn, bucket, limits, (0, 0))


def test_charges_take_from_both_buckets_until_one_is_short_and_a_refusal_takes_nothing(conn):
    limits = (3, 10)  # a request every 20 s, a token every 6 s
    first = time.monotonic()
    for remaining in (2, 1, 0):
        charged = rate_limit.charge(conn, A, limits, (1, 2))
        assert charged.refused_by is None and charged.retry_after_ms == 0
        assert figures(charged) == {
            REQUESTS: (3, remaining),
            TOKENS: (10, 10 - 2 * (3 - remaining)),
        }
    held = conn.hgetall(A)
    refused = rate_limit.charge(conn, A, limits, (1, 2))
    since_first_ms = (time.monotonic() - first) * 1000
    assert refused.refused_by == REQUESTS
    # one request comes back every 20 s; the first was taken `since_first_ms` ago
    assert 20_000 - since_first_ms - 1 < refused.retry_after_ms <= 20_000
    assert conn.hgetall(A) == held  # nothing was taken
    assert figures(refused) == {REQUESTS: (3, 0), TOKENS: (10, 4)}


def test_the_tokens_bucket_refuses_by_itself_and_says_so(conn):
    limits = (10, 10)  # one request and one token every 6 s
    start = time.monotonic()
    assert rate_limit.charge(conn, A, limits, (1, 8)).refused_by is None
    refused = rate_limit.charge(conn, A, limits, (1, 3))
    since_ms = (time.monotonic() - start) * 1000
    assert refused.refused_by == TOKENS
    assert 6_000 - since_ms - 1 < refused.retry_after_ms <= 6_000  # one token short
    assert figures(refused) == {REQUESTS: (10, 9), TOKENS: (10, 2)}


def test_a_limit_that_is_off_has_no_bucket(conn):
    charged = rate_limit.charge(conn, A, (0, 5), (1, 1))
    assert [b.name for b in charged.buckets] == [TOKENS]
    assert set(conn.hkeys(A)) == {TOKENS.encode()}
    assert rate_limit.charge(conn, A, (0, 5), (1, 5)).refused_by == TOKENS


def test_a_bucket_refills_continuously(conn):
    limits = (0, 60_000)  # one token per ms
    start = time.monotonic()
    emptied = rate_limit.charge(conn, A, limits, (0, 60_000))
    charged = time.monotonic()
    assert figures(emptied)[TOKENS] == (60_000, 0)
    assert 59_000 < emptied.buckets[0].reset_ms <= 60_000
    time.sleep(0.3)
    before = time.monotonic()
    refilled = look(conn, A, limits).buckets[0]
    after = time.monotonic()
    # a token back for each ms between the charge and the look, as Redis timed them
    assert (before - charged) * 1000 - 1 <= refilled.remaining <= (after - start) * 1000 + 1
    assert abs(refilled.reset_ms - (60_000 - refilled.remaining)) <= 1


def test_a_refused_caller_is_let_through_once_enough_time_has_passed(conn):
    limits = (3, 0)
    for _ in range(3):
        rate_limit.charge(conn, A, limits, (1, 0))
    assert rate_limit.charge(conn, A, limits, (1, 0)).refused_by == REQUESTS
    # 20 s later, as far as the bucket knows: its full-again time moved 20 s back
    full_at = float(conn.hget(A, REQUESTS))
    conn.hset(A, REQUESTS, repr(full_at - 20_000))
    assert rate_limit.charge(conn, A, limits, (1, 0)).refused_by is None
    assert rate_limit.charge(conn, A, limits, (1, 0)).refused_by == REQUESTS


def test_giving_back_never_fills_a_bucket_past_its_limit(conn):
    limits = (10, 10)
    rate_limit.charge(conn, A, limits, (2, 3))
    partly = rate_limit.charge(conn, A, limits, (-1, -1))
    assert figures(partly) == {REQUESTS: (10, 9), TOKENS: (10, 8)}
    full = rate_limit.charge(conn, A, limits, (-5, -50))
    assert figures(full) == {REQUESTS: (10, 10), TOKENS: (10, 10)}
    assert [b.reset_ms for b in full.buckets] == [0, 0]
    assert not conn.exists(A)  # a full bucket is not stored


def test_a_bucket_expires_when_it_is_full_again(conn):
    limits = (6, 600)  # 10 s per request, 100 ms per token
    start = time.monotonic()
    charged = rate_limit.charge(conn, A, limits, (1, 1))
    resets = {b.name: b.reset_ms for b in charged.buckets}
    assert 9_900 < resets[REQUESTS] <= 10_000 and 0 < resets[TOKENS] <= 100
    ttl = conn.pttl(A)
    waited_ms = (time.monotonic() - start) * 1000  # a stall on a busy machine counts here
    assert resets[REQUESTS] - waited_ms - 2 <= ttl <= resets[REQUESTS] + 2  # the later one
    start = time.monotonic()
    rate_limit.charge(conn, B, (0, 600), (0, 2))  # full again in 200 ms
    ttl = conn.pttl(B)
    waited_ms = (time.monotonic() - start) * 1000
    assert 200 - waited_ms - 2 <= ttl <= 202 and (ttl > 0 or waited_ms >= 198)
    time.sleep(0.3)
    assert not conn.exists(B)  # an idle caller leaves nothing behind


def test_a_look_changes_nothing(conn):
    rate_limit.charge(conn, A, (5, 10), (1, 1))
    held, ttl = conn.hgetall(A), conn.pttl(A)
    looked = look(conn, A, (5, 10))
    assert figures(looked) == {REQUESTS: (5, 4), TOKENS: (10, 9)}
    assert conn.hgetall(A) == held and conn.pttl(A) <= ttl
    assert figures(look(conn, B, (5, 10))) == {REQUESTS: (5, 5), TOKENS: (10, 10)}
    assert not conn.exists(B)


def test_two_callers_have_separate_buckets(conn):
    limits = (2, 10)
    rate_limit.charge(conn, A, limits, (1, 10))
    assert rate_limit.charge(conn, A, limits, (1, 1)).refused_by == TOKENS
    other = rate_limit.charge(conn, B, limits, (1, 6))
    assert other.refused_by is None
    assert figures(other) == {REQUESTS: (2, 1), TOKENS: (10, 4)}
    assert figures(look(conn, A, limits)) == {REQUESTS: (2, 1), TOKENS: (10, 0)}


def _reserve(conn, job_id: str, tokens: int, limits: tuple[int, int]) -> None:
    """Charge `tokens` to A and put the reservation on the job's record, as the API does."""
    assert rate_limit.charge(conn, A, limits, (1, tokens)).refused_by is None
    reservation = Reservation(A, tokens, WINDOW_MS / limits[1])
    conn.hset(keys.job(job_id), mapping=reservation.to_fields())


def test_settling_charges_what_the_job_used_once(conn):
    limits = (0, 6)  # 10 s per token: a test's stalls refill nothing
    job_id = submit(conn, COMPLETIONS, {"prompt": "x"})
    _reserve(conn, job_id, 5, limits)
    assert figures(look(conn, A, limits))[TOKENS] == (6, 1)
    assert rate_limit.settle(conn, job_id, used=2) == 1
    assert figures(look(conn, A, limits))[TOKENS] == (6, 4)
    assert not conn.hexists(keys.job(job_id), rate_limit.KEY_FIELD)
    assert rate_limit.settle(conn, job_id, used=0) == 0  # a second end settles nothing
    assert figures(look(conn, A, limits))[TOKENS] == (6, 4)


def test_settling_more_than_was_reserved_charges_the_difference(conn):
    limits = (0, 6)
    job_id = submit(conn, COMPLETIONS, {"prompt": "x"})
    _reserve(conn, job_id, 1, limits)
    rate_limit.settle(conn, job_id, used=4)
    assert figures(look(conn, A, limits))[TOKENS] == (6, 2)


def test_a_record_cannot_point_the_settlement_at_another_key(conn):
    job_id = submit(conn, COMPLETIONS, {"prompt": "x"})
    victim = keys.job(job_id)
    forged = Reservation(victim, 10, 100.0).to_fields()
    conn.hset(victim, mapping=forged)
    before = conn.hgetall(victim)
    assert rate_limit.settle(conn, job_id, used=0) == 0
    after = conn.hgetall(victim)
    assert after == {k: v for k, v in before.items() if k.decode() not in forged}


def test_the_final_append_settles_and_neither_a_retry_nor_a_fenced_out_one_does(conn):
    limits = (0, 6)
    job_id = submit(conn, COMPLETIONS, {"prompt": "x"})
    _reserve(conn, job_id, 5, limits)
    scripts.claim(conn, QUEUES, "w", 10_000)
    token = [("token", '{"index": 0}')]
    scripts.append(conn, job_id, "w:1", 0, token, {"completion_tokens": "1"}, used_tokens=1)
    assert figures(look(conn, A, limits))[TOKENS] == (6, 1)  # not the final write
    done = [("done", '{"id": "cmpl"}')]
    end = {"status": "finished"}
    assert scripts.append(conn, job_id, "x:1", 1, done, end, final=True, used_tokens=4) is None
    assert figures(look(conn, A, limits))[TOKENS] == (6, 1)  # fenced out: no settling
    scripts.append(conn, job_id, "w:1", 1, done, end, final=True, used_tokens=2)
    assert figures(look(conn, A, limits))[TOKENS] == (6, 4)
    scripts.append(conn, job_id, "w:1", 1, done, end, final=True, used_tokens=2)  # retried
    assert figures(look(conn, A, limits))[TOKENS] == (6, 4)


def test_the_record_keeps_the_reservation_under_the_fields_the_scripts_read():
    reservation = Reservation(A, 42, 12.5)
    record = JobRecord(id="j", endpoint=COMPLETIONS, model=TINY, request={})
    record.ratelimit_key, record.ratelimit_tokens, record.ratelimit_token_ms = A, 42, 12.5
    stored = record.to_hash()
    assert {k: stored[k] for k in reservation.to_fields()} == reservation.to_fields()
    again = JobRecord.from_hash(stored)
    assert dataclasses.astuple(again) == dataclasses.astuple(record)
    plain = JobRecord.from_hash(
        JobRecord(id="j", endpoint=COMPLETIONS, model=TINY, request={}).to_hash()
    )
    assert plain.ratelimit_key is None and plain.ratelimit_tokens is None


def test_a_job_cancelled_before_a_worker_ran_it_gives_back_its_whole_reservation(conn):
    limits = (0, 6000)
    job_id = submit(conn, COMPLETIONS, {"prompt": "x"})
    _reserve(conn, job_id, 700, limits)
    EventWriter(conn, "w", set(), RedisEvents(conn)).cancel_unclaimed(job_id)
    assert conn.hget(keys.job(job_id), "status") == b"cancelled"
    assert figures(look(conn, A, limits))[TOKENS] == (6000, 6000)
