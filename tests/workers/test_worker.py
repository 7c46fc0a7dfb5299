"""The worker end to end against real Redis, run in a thread: jobs go queued -> started ->
finished/failed/cancelled in our records and in RQ, their streams hold the tokens then the
OpenAI body, and nothing a job does takes the worker down."""

from __future__ import annotations

import base64
import json
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.serializers import JSONSerializer

from tests.workers.conftest import (
    TINY,
    WorkerThread,
    record,
    stream,
    submit,
    tokens,
    wait_done,
    wait_for,
)
from workers import keys, scripts
from workers.wire.commands import encode_command
from workers.wire.errors import cancelled_error
from workers.wire.job import CANCELLED, CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS, FAILED, FINISHED
from workers.wire.worker_info import WorkerInfo

pytestmark = pytest.mark.integration

GREEDY = {"model": TINY, "temperature": 0, "ignore_eos": True}


def rq_job(conn, job_id: str) -> Job:
    return Job.fetch(job_id, connection=conn, serializer=JSONSerializer)


def wait_rq_status(conn, job_id: str, status: JobStatus) -> None:
    """The worker closes RQ's side of a job just after our record's terminal status, so a
    test that saw the record end waits (briefly) for RQ's status rather than racing it."""
    wait_for(lambda: rq_job(conn, job_id).get_status() == status, 5, f"RQ status {status}")


def rq_queue(conn, kind: str = keys.INTERACTIVE) -> Queue:
    return Queue(keys.queue_name(TINY, kind), connection=conn, serializer=JSONSerializer)


def test_completion_runs_to_an_openai_body_in_stream_record_and_rq(conn, start_worker):
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "hello there", "max_tokens": 12})
    worker = start_worker()
    done = wait_done(conn, job_id)

    assert done.status == FINISHED and done.attempts == 1 and done.worker == worker.name
    assert done.started_at <= done.finished_at
    events = stream(conn, job_id)
    assert [kind for kind, _ in events] == ["token"] * 12 + ["done"]
    assert [data["index"] for _, data in events[:-1]] == list(range(12))
    body = events[-1][1]
    assert body == done.result
    assert body["id"] == f"cmpl-{job_id}" and body["object"] == "text_completion"
    assert body["model"] == TINY and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["finish_reason"] == "length"
    assert choice["text"] == "".join(data["text"] for _, data in events[:-1])
    assert body["usage"]["completion_tokens"] == 12 == done.completion_tokens
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 12

    wait_rq_status(conn, job_id, JobStatus.FINISHED)
    assert job_id in rq_queue(conn).finished_job_registry
    assert rq_queue(conn).started_job_registry.get_job_ids() == []
    assert not conn.smembers(keys.RUNNING) and not conn.exists(keys.job_lease(job_id))


def test_chat_with_n_and_logprobs(conn, start_worker):
    body = {
        **GREEDY,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 3,
        "seed": 7,
    }
    job_id = submit(conn, CHAT_COMPLETIONS, body)
    start_worker()
    result = wait_done(conn, job_id).result

    assert result["object"] == "chat.completion" and result["id"] == f"chatcmpl-{job_id}"
    assert [c["index"] for c in result["choices"]] == [0, 1]
    for choice in result["choices"]:
        assert choice["message"]["role"] == "assistant"
        content = choice["logprobs"]["content"]
        assert len(content) == 5
        for entry in content:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert len(entry["top_logprobs"]) == 3
    assert result["usage"]["completion_tokens"] == 10
    streamed = tokens(conn, job_id)
    assert {t["choice"] for t in streamed} == {0, 1}
    assert all(t["logprobs"]["bytes"] is not None for t in streamed)


def test_completion_echo_with_logprobs_uses_the_legacy_layout(conn, start_worker):
    body = {**GREEDY, "prompt": "the cat", "max_tokens": 4, "echo": True, "logprobs": 2}
    job_id = submit(conn, COMPLETIONS, body)
    start_worker()
    [choice] = wait_done(conn, job_id).result["choices"]

    assert choice["text"].startswith("the cat")
    lp = choice["logprobs"]
    n = len(lp["tokens"])
    assert n == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert all(len(top) <= 3 for top in lp["top_logprobs"][1:])


def test_list_of_prompts_times_n_gives_ordered_choices(conn, start_worker):
    body = {**GREEDY, "prompt": ["one", "two"], "n": 2, "max_tokens": 3}
    job_id = submit(conn, COMPLETIONS, body)
    start_worker()
    result = wait_done(conn, job_id).result
    assert [c["index"] for c in result["choices"]] == [0, 1, 2, 3]
    assert result["usage"]["completion_tokens"] == 12


def test_embeddings_float_and_base64(conn, start_worker):
    as_float = submit(conn, EMBEDDINGS, {"model": TINY, "input": ["a b", "c"]})
    as_b64 = submit(conn, EMBEDDINGS, {"model": TINY, "input": "a b", "encoding_format": "base64"})
    start_worker()
    floats = wait_done(conn, as_float).result
    encoded = wait_done(conn, as_b64).result

    assert floats["object"] == "list" and [d["index"] for d in floats["data"]] == [0, 1]
    vector = np.array(floats["data"][0]["embedding"])
    assert abs(np.linalg.norm(vector) - 1) < 1e-5
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(decoded, vector, rtol=1e-6)
    assert floats["usage"]["prompt_tokens"] == floats["usage"]["total_tokens"] > 0
    assert [kind for kind, _ in stream(conn, as_float)] == ["done"]


def test_concurrent_jobs_share_decode_steps(conn, start_worker):
    ids = [
        submit(conn, COMPLETIONS, {**GREEDY, "prompt": f"job {i}", "max_tokens": 20})
        for i in range(3)
    ]
    worker = start_worker(max_sequences=8)
    done = [wait_done(conn, job_id) for job_id in ids]

    assert all(d.status == FINISHED for d in done)
    assert worker.steps < 30  # 60 tokens in one batch; one at a time would take 60 steps
    latest_start = max(d.started_at for d in done)
    assert all(latest_start < d.finished_at for d in done)  # all three ran at once
    sizes = conn.hgetall(keys.METRIC_STEP_SIZE)
    assert int(sizes[f"{TINY}|4".encode()]) > 0  # steps of 3 sequences fall in the "4" bucket


def test_interactive_jobs_start_before_batch_jobs(conn, start_worker):
    batch = [
        submit(conn, COMPLETIONS, {**GREEDY, "prompt": "b", "max_tokens": 3}, kind=keys.BATCH)
        for _ in range(2)
    ]
    interactive = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "i", "max_tokens": 3})
    start_worker(max_sequences=1)
    first = wait_done(conn, interactive)
    later = [wait_done(conn, job_id) for job_id in batch]
    assert all(first.started_at < job.started_at for job in later)


def test_cancel_stops_a_running_job_within_a_few_tokens(conn, start_worker):
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "go", "max_tokens": 200})
    worker = start_worker(step_delay=0.02)
    wait_for(lambda: len(tokens(conn, job_id)) >= 3, what="a few tokens")
    with conn.pipeline() as pipe:  # MULTI: the events there when the flag was set, however
        pipe.set(keys.job_cancel(job_id), "1")  # long this thread waits for a core
        pipe.xlen(keys.job_events(job_id))
        sent_before = pipe.execute()[1]
    cancelled = wait_done(conn, job_id)

    assert cancelled.status == CANCELLED
    assert cancelled.error == cancelled_error()
    events = stream(conn, job_id)
    assert events[-1] == ("error", cancelled_error())
    assert len(events) - 1 <= sent_before + 3
    wait_rq_status(conn, job_id, JobStatus.CANCELED)
    assert job_id in rq_queue(conn).canceled_job_registry
    assert rq_queue(conn).started_job_registry.get_job_ids() == []
    assert worker.pool.get(TINY).in_flight == 0 and not worker.running.jobs


def test_a_job_cancelled_while_queued_never_runs(conn, start_worker):
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "never", "max_tokens": 5})
    conn.set(keys.job_cancel(job_id), "1")
    start_worker()
    cancelled = wait_done(conn, job_id)
    assert cancelled.status == CANCELLED and cancelled.attempts == 0
    assert stream(conn, job_id) == [("error", cancelled_error())]
    wait_rq_status(conn, job_id, JobStatus.CANCELED)


def test_a_job_calling_another_function_is_refused_not_run(conn, start_worker, tmp_path: Path):
    victim = tmp_path / "victim.txt"
    victim.write_text("still here")
    body = {**GREEDY, "prompt": "x"}
    job_id = submit(conn, COMPLETIONS, body, func="os.remove", args=[str(victim)])
    start_worker()
    failed = wait_done(conn, job_id)

    assert victim.exists()
    assert failed.status == FAILED and failed.error["status"] == 500
    assert failed.error["error"]["code"] == "job_refused"
    assert "os.remove" in failed.error["error"]["message"]
    wait_rq_status(conn, job_id, JobStatus.FAILED)


def test_a_model_that_fails_to_load_fails_its_jobs_and_the_worker_lives(
    conn, start_worker, tiny_model: Path, tmp_path: Path
):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF but not really" * 10)
    bad = submit(conn, COMPLETIONS, {"model": "broken", "prompt": "x"}, model="broken")
    start_worker([str(broken), str(tiny_model)])
    failed = wait_done(conn, bad)
    assert failed.status == FAILED
    assert failed.error["status"] == 500 and failed.error["error"]["type"] == "server_error"
    assert "broken" not in json.dumps(failed.error) or "load" in failed.error["error"]["message"]

    good = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "fine", "max_tokens": 2})
    assert wait_done(conn, good).status == FINISHED


def test_a_prompt_beyond_the_context_fails_with_a_400(conn, start_worker):
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "word " * 300, "max_tokens": 8})
    start_worker()
    failed = wait_done(conn, job_id)
    assert failed.status == FAILED
    assert failed.error["status"] == 400
    assert failed.error["error"]["type"] == "invalid_request_error"
    assert "context length" in failed.error["error"]["message"]
    assert stream(conn, job_id) == [("error", failed.error)]
    wait_rq_status(conn, job_id, JobStatus.FAILED)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "   "}, "prompt"),
        ({"prompt": "x", "stop": [""]}, "stop"),
    ],
)
def test_bad_request_values_fail_with_a_400_naming_the_field(conn, start_worker, body, param):
    job_id = submit(conn, COMPLETIONS, {"model": TINY, **body})
    start_worker()
    failed = wait_done(conn, job_id)
    assert failed.error["status"] == 400 and failed.error["error"]["param"] == param


def test_a_job_for_a_model_the_worker_does_not_know_is_a_404(conn, start_worker):
    job_id = submit(conn, COMPLETIONS, {"model": "nope", "prompt": "x"})
    conn.hset(keys.job(job_id), "model", "nope")
    start_worker()
    failed = wait_done(conn, job_id)
    assert failed.error["status"] == 404
    assert failed.error["error"]["code"] == "model_not_found"


def test_worker_publishes_itself_and_obeys_admin_load_and_unload(conn, start_worker):
    worker = start_worker()
    raw = wait_for(lambda: conn.hgetall(keys.worker(worker.name)), what="worker hash")
    info = WorkerInfo.from_hash(raw)
    assert info.models == [TINY] and info.is_alive() and info.state == "idle"
    own = keys.personal_queue_name(TINY, worker.name)  # prefix-affinity routing's own queue
    assert info.queues == [own, keys.queue_name(TINY), keys.queue_name(TINY, keys.BATCH)]
    assert info.max_sequences == worker.config.max_sequences == 32  # the cpu's default
    assert info.device == "cpu"  # no --device, and a .gguf path has no registry device
    assert conn.sismember(keys.WORKERS, worker.name)
    assert json.loads(conn.hget(keys.MODELS, TINY))["id"] == TINY

    def pool_state() -> dict:
        return WorkerInfo.from_hash(conn.hgetall(keys.worker(worker.name))).pool

    conn.lpush(keys.worker_commands(worker.name), encode_command("load", TINY))
    wait_for(lambda: pool_state().get(TINY, {}).get("state") == "ready", what="model ready")
    assert pool_state()[TINY]["device"] == "cpu"
    assert json.loads(conn.hget(keys.MODELS, TINY))["context_length"] == 256
    conn.lpush(keys.worker_commands(worker.name), encode_command("unload", TINY))
    wait_for(lambda: TINY not in pool_state(), what="model unloaded")


def test_a_worker_publishes_where_its_loop_spent_each_decode_step(conn, start_worker):
    worker = start_worker()
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "hello there", "max_tokens": 12})
    wait_done(conn, job_id)

    def loop() -> dict:
        return WorkerInfo.from_hash(conn.hgetall(keys.worker(worker.name))).loop

    # published when the job's end changes the pool's in-flight count (workers/presence.py)
    out = wait_for(lambda: loop() if loop().get("steps", 0) >= 11 else None, what="loop")
    assert out["steps"] >= 11  # the first token comes from the prefill step
    assert out["step_ms"] > 0 and out["writes_ms"] >= 0 and 0 < out["busy"] <= 1
    per_step = sum(out[f"{p}_ms"] for p in ("chores", "claim", "step", "writes", "ends"))
    assert per_step * out["steps"] / 1000 <= out["seconds"]


def test_a_worker_whose_loop_keeps_failing_still_stops_when_its_grace_is_over(
    conn, tiny_model, redis_url
):
    runner = WorkerThread(redis_url, [str(tiny_model)], grace=0.5)
    worker = runner.__enter__()
    wait_for(lambda: conn.exists(keys.worker(worker.name)), what="worker registered")

    def broken_tick() -> None:
        raise RuntimeError("a tick that fails every time")

    worker._tick = broken_tick  # as a broken or half-upgraded worker's loop would
    time.sleep(1.5)
    assert runner.thread.is_alive()  # failing and carrying on, as long as nobody stops it
    started = time.monotonic()
    worker.request_stop(signal.SIGTERM, None)  # one signal: drain, with 0.5 s of grace
    runner.thread.join(10)
    assert not runner.thread.is_alive(), "the worker did not stop"
    assert time.monotonic() - started < 5  # its grace, and the 1 s pause after a failure
    worker.connection.close()


def test_a_worker_loads_its_model_as_it_starts_not_on_the_first_job(conn, start_worker):
    """The first job finds the model loaded (it was loaded before the job was queued), and
    `keys.MODELS` says whether chat requests can be rendered, which the dashboard reads."""
    worker = start_worker()

    def pool() -> dict:
        raw = conn.hgetall(keys.worker(worker.name))
        return WorkerInfo.from_hash(raw).pool if raw else {}

    ready = wait_for(lambda: pool().get(TINY, {}).get("state") == "ready" and pool()[TINY])
    assert json.loads(conn.hget(keys.MODELS, TINY))["chat_template"] is True
    queued_at = time.time()
    assert ready["loaded_at"] < queued_at
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "hello", "max_tokens": 2})
    assert wait_done(conn, job_id).status == FINISHED
    assert pool()[TINY]["loaded_at"] == ready["loaded_at"]  # the same load served it


def test_gpu_and_cpu_workers_of_one_model_both_show_in_admin_with_their_devices(conn, start_worker):
    """Queues are per model, so a GPU worker beside a CPU one needs nothing new: both serve
    the same queue and /admin shows where each runs. The GPU worker is its presence record
    (this machine has no GPU), written as a worker writes it."""
    from api.app import create_app
    from workers.presence import Presence

    cpu = start_worker(device="cpu")
    wait_for(lambda: conn.hgetall(keys.worker(cpu.name)), what="cpu worker hash")
    pool = {TINY: {"state": "ready", "device": "cuda:0", "memory_mb": 900.0, "in_flight": 0}}
    info = WorkerInfo("gpu-1", pid=7, queues=[keys.queue_name(TINY)], models=[TINY])
    info.device = "cuda:0"
    Presence(conn, info, {}).publish("idle", [], pool)
    client = create_app({"TESTING": True, "REDIS_CLIENT": conn}).test_client()

    def devices() -> dict:
        data = client.get("/admin/workers").get_json()["data"]
        return {w["name"]: (w["device"], w["pool"].get(TINY, {}).get("device")) for w in data}

    wait_for(lambda: devices().get(cpu.name) == ("cpu", "cpu"), what="cpu worker's model ready")
    assert devices() == {cpu.name: ("cpu", "cpu"), "gpu-1": ("cuda:0", "cuda:0")}
    [model] = [m for m in client.get("/admin/models").get_json()["data"] if m["id"] == TINY]
    assert sorted(model["serving"]) == sorted([cpu.name, "gpu-1"])
    assert model["pools"]["gpu-1"]["device"] == "cuda:0"
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "hello", "max_tokens": 2})
    assert wait_done(conn, job_id).status == FINISHED  # the shared queue, run by the cpu one


def test_without_models_named_a_worker_preloads_only_the_default_one():
    from runtime.registry import DEFAULT_MODEL
    from workers.config import WorkerConfig, preload_models, serving

    everything = WorkerConfig()
    assert preload_models(everything, serving(everything)[0]) == [DEFAULT_MODEL]
    named = WorkerConfig(models=["gemma-3-270m", DEFAULT_MODEL])
    assert preload_models(named, serving(named)[0]) == ["gemma-3-270m", DEFAULT_MODEL]
    assert preload_models(WorkerConfig(models=["gemma-3-270m"], preload=False), {}) == []


def test_a_worker_that_lost_the_lease_stops_writing(conn, start_worker):
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "fence", "max_tokens": 200})
    worker = start_worker(step_delay=0.02)
    wait_for(lambda: len(tokens(conn, job_id)) >= 3, what="a few tokens")
    conn.set(keys.job_lease(job_id), "someone-else:9")  # another worker took the job over
    wait_for(lambda: not worker.running.jobs, what="the job to be dropped")
    frozen = len(stream(conn, job_id))
    time.sleep(0.2)
    assert len(stream(conn, job_id)) == frozen
    assert record(conn, job_id).status == "started"  # the new owner decides its end


def test_a_job_requeued_while_it_runs_here_is_taken_over_by_the_new_claim(conn, start_worker):
    """A reaper requeued the job while this worker still ran it (its lease lapsed while Redis
    was away) and this worker claims it again before its writes hear of it: the new run
    replaces the old one and resumes from the stream, with nothing lost or repeated."""
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "again", "max_tokens": 200})
    worker = start_worker(step_delay=0.02, lease_ttl=120, lease_renew=60)
    wait_for(lambda: len(tokens(conn, job_id)) >= 3, what="a few tokens")
    conn.set(keys.job_lease(job_id), "reaper:other")
    rq_key = f"rq:job:{job_id}"
    with conn.pipeline(transaction=True) as pipe:  # no claim in between
        scripts.requeue(pipe, job_id, "reaper:other", rq_queue(conn).key, rq_key)
        pipe.set(keys.job_lease(job_id), f"{worker.name}:1")  # the old run still writes
        assert pipe.execute()[0] == 1
    done = wait_done(conn, job_id)
    assert done.status == FINISHED and done.attempts == 2 and done.worker == worker.name
    indexes = [data["index"] for kind, data in stream(conn, job_id) if kind == "token"]
    assert indexes == list(range(200))


def test_the_reaper_requeues_a_job_whose_worker_vanished(conn, start_worker):
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "ghost", "max_tokens": 4})
    queue_key = rq_queue(conn).key
    claimed = scripts.claim(conn, [queue_key], "ghost", lease_ms=200)  # dies right away
    assert claimed == (0, job_id, 1)
    worker = start_worker(reap_interval=0.1)
    done = wait_done(conn, job_id)
    assert done.status == FINISHED and done.attempts == 2 and done.worker == worker.name
    # RQ's bookkeeping is written after the record's terminal status
    wait_rq_status(conn, job_id, JobStatus.FINISHED)


def test_a_job_that_ended_before_its_worker_died_is_settled_and_counted_once(conn, start_worker):
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "ended", "max_tokens": 4})
    queue_key = rq_queue(conn).key
    assert scripts.claim(conn, [queue_key], "ghost", lease_ms=60_000) == (0, job_id, 1)
    done = [("done", '{"id": "cmpl"}')]
    assert scripts.append(conn, job_id, "ghost:1", 0, done, {"status": FINISHED}, final=True)
    conn.lpush(queue_key, job_id)  # it died before RQ heard of the end; the job came back
    start_worker()
    wait_rq_status(conn, job_id, JobStatus.FINISHED)
    assert len(stream(conn, job_id)) == 1  # never run again
    assert conn.hget(keys.METRIC_JOBS, FINISHED) == b"1"


@pytest.mark.slow
def test_smollm2_chat_job_matches_the_engine_run_in_process(conn, start_worker):
    from runtime.engine import Engine
    from runtime.sampling import SamplingParams

    # "What is the capital of France?" is a near tie for SmolLM2 ("The" vs "L", 0.08 apart
    # in float32, 0 after bf16 rounding): which one wins says nothing about the system
    messages = [{"role": "user", "content": "Name the capital city of France."}]
    body = {"model": "smollm2-135m-instruct", "messages": messages, "max_tokens": 8}
    job_id = submit(conn, CHAT_COMPLETIONS, {**body, "temperature": 0}, model=body["model"])
    worker = start_worker(["smollm2-135m-instruct"])
    result = wait_done(conn, job_id, timeout=180).result

    # a fresh engine of the same config, cold, as the worker's first job was
    served = worker.pool.get("smollm2-135m-instruct").engine
    engine = Engine.load("smollm2-135m-instruct", served.config)
    ids = engine.encode_chat(messages)
    expected = engine.generate(ids, SamplingParams(max_tokens=8, temperature=0))
    content = result["choices"][0]["message"]["content"]
    assert content == "".join(event.text for event in expected)
    assert "Paris" in content
    assert result["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.slow
def test_the_same_greedy_chat_gets_the_same_answer_cold_and_from_the_prefix_cache(
    conn, start_worker
):
    """docs/contract.md "same request, same answer": the first run prefills the whole
    prompt, the next two hit the worker's prefix cache and prefill only the rest."""
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    start_worker(["smollm2-135m-instruct"])
    results = []
    for _ in range(3):
        job_id = submit(conn, CHAT_COMPLETIONS, body, model=body["model"])
        results.append(wait_done(conn, job_id, timeout=180).result)
    cached = [r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in results]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > 0, cached
    answers = [r["choices"][0]["message"]["content"] for r in results]
    assert answers[0] == answers[1] == answers[2], answers


def test_rq_sees_every_running_job_as_started_with_its_own_execution(conn, start_worker):
    ids = [
        submit(conn, COMPLETIONS, {**GREEDY, "prompt": f"run {i}", "max_tokens": 200})
        for i in range(2)
    ]
    worker = start_worker(step_delay=0.02)
    wait_for(lambda: all(tokens(conn, job_id) for job_id in ids), what="both jobs running")

    registry = rq_queue(conn).started_job_registry
    assert sorted(registry.get_job_ids()) == sorted(ids)
    assert all(rq_job(conn, job_id).get_status() == JobStatus.STARTED for job_id in ids)
    assert all(record(conn, job_id).status == "started" for job_id in ids)
    rq_worker = conn.hgetall(f"rq:worker:{worker.name}")
    assert rq_worker[b"state"] == b"busy" and rq_worker[b"current_job"].decode() in ids
    assert sorted(m.decode() for m in conn.smembers(keys.RUNNING)) == sorted(ids)

    for job_id in ids:
        conn.set(keys.job_cancel(job_id), "1")
    for job_id in ids:
        assert wait_done(conn, job_id).status == CANCELLED
    # RQ's side is closed after the write that ends the job (workers/rq_registries.py), so
    # beside other load it can follow the record by a moment
    wait_for(lambda: registry.get_job_ids() == [], what="RQ's started registry to empty")
    wait_for(
        lambda: conn.hget(f"rq:worker:{worker.name}", "state") == b"idle",
        what="the worker idle in RQ",
    )


def test_leases_are_renewed_while_a_job_outlives_their_ttl(conn, start_worker):
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "long", "max_tokens": 60})
    start_worker(step_delay=0.03, lease_ttl=0.6, lease_renew=0.2, reap_interval=0.1)
    done = wait_done(conn, job_id, timeout=20)
    assert done.status == FINISHED and done.attempts == 1  # never reaped from under itself


def test_a_plain_rq_worker_fails_llmq_jobs_visibly_instead_of_hanging(conn):
    from rq import SimpleWorker

    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "wrong worker"})
    SimpleWorker([rq_queue(conn)], connection=conn, serializer=JSONSerializer).work(burst=True)
    failed = record(conn, job_id)
    assert failed.status == FAILED and failed.error["error"]["code"] == "wrong_worker"
    assert stream(conn, job_id) == [("error", failed.error)]
    wait_rq_status(conn, job_id, JobStatus.FAILED)


def test_a_job_that_keeps_losing_its_workers_is_failed_not_retried_forever(conn, start_worker):
    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "poison"})
    conn.hset(keys.job(job_id), "attempts", 5)  # five workers died running it
    start_worker()
    failed = wait_done(conn, job_id)
    assert failed.status == FAILED and failed.attempts == 6
    assert "started 5 times" in failed.error["error"]["message"]


def test_rq_stop_job_command_cancels_a_running_job(conn, start_worker):
    from rq.command import send_stop_job_command

    job_id = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "stop me", "max_tokens": 200})
    start_worker(step_delay=0.02)
    wait_for(lambda: tokens(conn, job_id), what="the job to run")
    send_stop_job_command(conn, job_id, serializer=JSONSerializer)
    assert wait_done(conn, job_id).status == CANCELLED


def test_two_workers_never_run_the_same_job(conn, start_worker):
    ids = [
        submit(conn, COMPLETIONS, {**GREEDY, "prompt": f"p{i}", "max_tokens": 8}) for i in range(8)
    ]
    start_worker(max_sequences=2)
    start_worker(max_sequences=2)
    done = [wait_done(conn, job_id) for job_id in ids]
    assert all(d.status == FINISHED and d.attempts == 1 for d in done)
    assert all(len(tokens(conn, job_id)) == 8 for job_id in ids)


def test_prefix_cache_hits_are_counted(conn, start_worker):
    body = {**GREEDY, "prompt": "a shared prefix " * 8, "max_tokens": 2}
    first = submit(conn, COMPLETIONS, body)
    worker = start_worker()
    cold = wait_done(conn, first)
    second = submit(conn, COMPLETIONS, body)
    warm = wait_done(conn, second)
    cache = {k.decode(): int(v) for k, v in conn.hgetall(keys.METRIC_PREFIX_CACHE).items()}
    assert cache[f"{TINY}|prompt_tokens"] > 0 and cache.get(f"{TINY}|hit_tokens", 0) > 0
    # each response reports what the cache served, as OpenAI's prompt caching does
    assert cold.result["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = warm.result["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0 and cached < warm.result["usage"]["prompt_tokens"]
    assert warm.result["choices"] == cold.result["choices"]  # greedy: cached == cold output

    def published() -> dict | None:  # /admin/models reads this from the worker's hash
        pool = WorkerInfo.from_hash(conn.hgetall(keys.worker(worker.name))).pool
        stats = pool.get(TINY, {}).get("prefix_cache")
        return stats if stats and stats["hits"] else None

    stats = wait_for(published, timeout=15, what="prefix cache stats in the worker hash")
    assert stats["cached_tokens"] == cached and 0 < stats["hit_rate"] < 1


def test_a_steps_writes_go_out_beside_the_next_step_and_keep_every_event_in_order(
    conn, start_worker
):
    """Each step's write is held until the loop has started the next step (or waits for the
    write, or has no step left to run): a write counts as beside the next step when a step
    started after the loop handed the write over. The count of steps at the hand-over is
    taken in the loop's own thread, so how soon the writer thread runs changes nothing. No
    lease renewal falls in the test (a renewal waits for the write); the writes the loop
    waits for are those after a job's end and the last one."""
    worker = start_worker(max_sequences=4, lease_ttl=60, lease_renew=30)
    wait_for(lambda: conn.hexists(keys.MODELS, TINY), what="the model published")
    entered: list[int] = []
    handed_over = [0]  # steps entered when the loop handed the write in flight over
    collecting = threading.Event()
    beside: list[bool] = []
    real_step, real_execute = worker.running.step, worker.writer._execute
    real_collect, real_send = worker.writer.collect, worker.writer.send

    def step():
        entered.append(1)
        return real_step()

    def collect():
        collecting.set()
        try:
            return real_collect()
        finally:
            collecting.clear()

    def send(jobs, step_sizes, background=False):
        if background:
            handed_over[0] = len(entered)
        return real_send(jobs, step_sizes, background=background)

    def execute(sent):
        if not threading.current_thread().name.startswith("llmq-writer"):
            return real_execute(sent)  # a write the loop waits for
        seen = handed_over[0]
        while len(entered) == seen and worker.running.has_work() and not collecting.is_set():
            time.sleep(0.001)
        beside.append(len(entered) > seen)
        return real_execute(sent)

    worker.running.step, worker.writer._execute = step, execute
    worker.writer.collect, worker.writer.send = collect, send
    ids = [
        submit(conn, COMPLETIONS, {**GREEDY, "prompt": f"side {i}", "max_tokens": 16})
        for i in range(3)
    ]
    done = [wait_done(conn, job_id, timeout=30) for job_id in ids]
    assert all(d.status == FINISHED for d in done)
    for job_id in ids:
        events = stream(conn, job_id)
        assert [kind for kind, _ in events] == ["token"] * 16 + ["done"]
        assert [data["index"] for _, data in events[:-1]] == list(range(16))
    assert sum(beside) >= 12  # nearly every step's write went out while the next step ran


def test_a_job_whose_end_is_in_flight_is_not_taken_for_a_lost_lease(conn, start_worker):
    """The final write gives the lease up; a renewal that runs before the loop has heard
    back from that write must not drop the job, or RQ would never hear that it finished."""
    start_worker(max_sequences=4, lease_renew=0.001)  # a renewal every tick
    ids = [
        submit(conn, COMPLETIONS, {**GREEDY, "prompt": f"renew {i}", "max_tokens": 3})
        for i in range(8)
    ]
    assert all(wait_done(conn, job_id).status == FINISHED for job_id in ids)
    for job_id in ids:
        wait_rq_status(conn, job_id, JobStatus.FINISHED)


def test_a_busy_worker_looks_for_jobs_between_steps_only_now_and_then(
    conn, start_worker, monkeypatch
):
    """A claim is a round trip: with sequences running, it is made at most every
    CLAIM_WHILE_BUSY_SECONDS, not before every step (a GPU steps hundreds of times a
    second); a job queued meanwhile is still taken once the interval has passed."""
    from workers import worker as worker_module

    monkeypatch.setattr(worker_module, "CLAIM_WHILE_BUSY_SECONDS", 0.5)
    first = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "long", "max_tokens": 200})
    worker = start_worker(max_sequences=8, step_delay=0.01)  # 200 steps take over 2 s
    takes: list[float] = []
    take = worker.claims.take
    monkeypatch.setattr(
        worker.claims, "take", lambda *a, **k: takes.append(time.time()) or take(*a, **k)
    )
    wait_for(lambda: worker.steps >= 20, what="20 steps of the first job")
    second = submit(conn, COMPLETIONS, {**GREEDY, "prompt": "late", "max_tokens": 4})
    done = [wait_done(conn, job_id) for job_id in (first, second)]
    assert all(d.status == FINISHED for d in done)
    assert done[1].finished_at < done[0].finished_at  # taken while the first still ran
    busy = [t for t in takes if t <= done[0].finished_at]
    steps = worker.steps
    assert len(busy) < steps / 4, f"{len(busy)} claims over {steps} steps"
