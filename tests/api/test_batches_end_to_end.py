"""Offline batches end to end: the official `openai` client against the API on a real HTTP
server, real `llmq worker` processes serving a tiny model, real Redis (db 11, flushed
before and after each test). Includes docs/faults.md F13 at full size: 10,000 lines, a worker's
whole process tree killed half-way, and every valid line still answered exactly once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest
import redis

from api.app import create_app
from tests.api.conftest import serving
from tests.redis_db import clean_redis_db
from tests.workers.conftest import REPO, WorkerProcess, serving_workers
from workers import keys

pytestmark = pytest.mark.integration

REDIS_URL = os.environ.get("LLMQ_BATCH_TEST_REDIS_URL", "redis://127.0.0.1:6379/11")
MODEL = "tiny-batch"
TOKENS = 8  # every line generates exactly this many tokens (ignore_eos)
F13_LINES, F13_VALID = 10_000, 9_900  # docs/faults.md F13: 1% of the lines are invalid
F13_TOKENS = 4  # short generations, so that 10,000 lines run in about a minute
F13_MAX_SEQUENCES = 64


@pytest.fixture
def conn() -> Iterator[redis.Redis]:
    with clean_redis_db(REDIS_URL) as client:
        yield client


@pytest.fixture
def server(conn: redis.Redis) -> Iterator[str]:
    app = create_app({"TESTING": True, "REDIS_URL": REDIS_URL})
    with serving(app) as url:
        yield url
    app.extensions["redis"].close()


@pytest.fixture
def workers(conn: redis.Redis, tiny_model: Path) -> Iterator[Callable[..., WorkerProcess]]:
    with serving_workers(conn, tiny_model, REDIS_URL) as start:
        yield start


def write_input(path: Path, count: int, invalid_every: int = 0) -> tuple[set[str], set[str]]:
    """`count` lines; every `invalid_every`-th is broken (alternately bad JSON and an
    unknown model). Returns (valid custom_ids, invalid custom_ids or "" for no id)."""
    valid, invalid, lines = set(), set(), []
    for i in range(count):
        line = chat_line(i)
        custom_id = line["custom_id"]
        if invalid_every and i % invalid_every == invalid_every - 1:
            if (i // invalid_every) % 2:
                lines.append('{"custom_id": "' + custom_id + '", broken')
                invalid.add("")
            else:
                lines.append(json.dumps({**line, "body": {**line["body"], "model": "no-such"}}))
                invalid.add(custom_id)
            continue
        lines.append(json.dumps(line))
        valid.add(custom_id)
    path.write_text("\n".join(lines) + "\n")
    return valid, invalid


def chat_line(i: int, tokens: int = TOKENS) -> dict[str, Any]:
    """A valid chat line with custom_id req-{i}."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"say {i}"}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


# line -> (custom_id its error record carries, error code, HTTP status of the response it
# carries: None for a line rejected when the batch was created, else the job's failure)
Broken = dict[int, tuple[str | None, str, int | None]]


def broken_line(kind: int, i: int, line: dict[str, Any]) -> tuple[str, str | None, str, int | None]:
    """The valid line `line` (index i) broken in one of eleven ways (by `kind`): its text, and
    the custom_id, code and response status its error record must have."""
    cid, body = line["custom_id"], line["body"]
    no_id = {k: v for k, v in line.items() if k != "custom_id"}
    long_prompt = [{"role": "user", "content": "x" * 400}]  # over the 256-token context
    cases: list[tuple[Any, str | None, str, int | None]] = [
        (json.dumps(line)[:-9] + ", broken", None, "invalid_json_line", None),
        ([cid], None, "invalid_json_line", None),  # JSON, but not an object
        (no_id, None, "missing_custom_id", None),
        ({**line, "custom_id": f"req-{i - 1}"}, f"req-{i - 1}", "duplicate_custom_id", None),
        ({**line, "url": "/v1/completions"}, cid, "mismatched_url", None),
        ({**line, "method": "GET"}, cid, "invalid_method", None),
        ({**line, "body": {"model": MODEL}}, cid, "invalid_request", None),  # no messages
        ({**line, "body": {**body, "max_tokens": 10**9}}, cid, "invalid_request", None),
        ({**line, "body": "say hi"}, cid, "invalid_request", None),  # body not an object
        ({**line, "body": {**body, "model": "no-such-model"}}, cid, "model_not_found", None),
        # valid JSON and fields, but only the worker's tokenizer can tell it is too long
        ({**line, "body": {**body, "messages": long_prompt}}, cid, "invalid_request_error", 400),
    ]
    data, custom_id, code, status = cases[kind % len(cases)]
    return (data if isinstance(data, str) else json.dumps(data)), custom_id, code, status


def write_f13_input(path: Path) -> tuple[dict[int, str], Broken]:
    """F13's input: every 100th line broken, cycling through `broken_line`'s kinds. Returns
    (line number -> custom_id of the valid lines, the broken lines)."""
    valid: dict[int, str] = {}
    invalid: Broken = {}
    texts = []
    for i in range(F13_LINES):
        number, line = i + 1, chat_line(i, F13_TOKENS)
        if i % 100 != 99:
            texts.append(json.dumps(line))
            valid[number] = line["custom_id"]
            continue
        text, custom_id, code, status = broken_line(i // 100, i, line)
        texts.append(text)
        invalid[number] = (custom_id, code, status)
    path.write_text("\n".join(texts) + "\n")
    return valid, invalid


def line_number(record: dict[str, Any], batch_id: str) -> int:
    """The input line a record answers: its id is batch_req_{batch}_{line}."""
    prefix = f"batch_req_{batch_id.removeprefix('batch_')}_"
    assert record["id"].startswith(prefix), record["id"]
    return int(record["id"].removeprefix(prefix))


def assert_output_exactly_once(
    output: list[dict[str, Any]], batch_id: str, valid: dict[int, str]
) -> None:
    """One successful record per valid line (by line number and by custom_id), in order."""
    numbers = [line_number(o, batch_id) for o in output]
    assert numbers == sorted(valid), "output lines missing, repeated or out of order"
    custom_ids = [o["custom_id"] for o in output]
    assert len(set(custom_ids)) == len(custom_ids)
    assert custom_ids == [valid[n] for n in numbers]
    for item in output:
        response = item["response"]
        assert item["error"] is None and response["status_code"] == 200
        assert response["body"]["usage"]["completion_tokens"] == F13_TOKENS


def assert_error_records(errors: list[dict[str, Any]], batch_id: str, invalid: Broken) -> None:
    """One error record per broken line, with its custom_id (None where it had no usable
    one), its code and a message; a line that ran also carries its job's failure."""
    by_line = {line_number(e, batch_id): e for e in errors}
    assert len(by_line) == len(errors) and set(by_line) == set(invalid)
    for number, (custom_id, code, status) in invalid.items():
        record = by_line[number]
        assert (record["custom_id"], record["error"]["code"]) == (custom_id, code), record
        assert record["error"]["message"]
        response = record["response"]
        assert (response and response["status_code"]) == status, record


def wait_status(
    oai: openai.OpenAI, batch_id: str, statuses: set[str], timeout: float, until: Any = None
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = oai.batches.retrieve(batch_id)
        if batch.status in statuses or (until is not None and until(batch)):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.1)


def lines_of(oai: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in oai.files.content(file_id).text.splitlines()]


def test_openai_client_runs_a_batch_with_invalid_lines(oai, workers, tmp_path) -> None:
    workers("batch-w1")
    valid, invalid = write_input(tmp_path / "in.jsonl", 30, invalid_every=10)
    with open(tmp_path / "in.jsonl", "rb") as handle:
        uploaded = oai.files.create(file=handle, purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == (tmp_path / "in.jsonl").stat().st_size
    batch = oai.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"suite": "e2e"},
    )
    assert batch.status == "validating" and batch.request_counts.failed == 3
    batch = wait_status(oai, batch.id, {"completed", "failed"}, 60)
    assert batch.status == "completed" and batch.completed_at >= batch.in_progress_at
    assert (batch.request_counts.completed, batch.request_counts.failed) == (27, 3)
    output = lines_of(oai, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(valid)
    for item in output:
        body = item["response"]["body"]
        assert item["response"]["status_code"] == 200 and item["error"] is None
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == TOKENS
    errors = lines_of(oai, batch.error_file_id)
    assert {e["custom_id"] or "" for e in errors} == invalid
    assert {e["error"]["code"] for e in errors} == {"invalid_json_line", "model_not_found"}
    assert batch.id in [b.id for b in oai.batches.list(limit=5)]
    assert batch.metadata == {"suite": "e2e"}
    assert batch.usage.output_tokens == 27 * TOKENS


def test_cancel_midway_gives_partial_output(oai, workers, tmp_path) -> None:
    # 8 at a time, so the cancel lands while most of the 48 lines are still queued
    workers("batch-w1", "--max-batch", "8", step_delay_ms=40)
    valid, _ = write_input(tmp_path / "in.jsonl", 48)
    with open(tmp_path / "in.jsonl", "rb") as handle:
        file_id = oai.files.create(file=handle, purpose="batch").id
    batch = oai.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_status(oai, batch.id, set(), 60, until=lambda b: b.request_counts.completed >= 8)
    assert oai.batches.cancel(batch.id).status == "cancelling"
    batch = wait_status(oai, batch.id, {"cancelled"}, 30)
    counts = batch.request_counts
    assert 8 <= counts.completed < 48 and counts.completed + counts.failed == 48
    output = lines_of(oai, batch.output_file_id)
    errors = lines_of(oai, batch.error_file_id)
    assert len(output) == counts.completed
    answered = [o["custom_id"] for o in output] + [e["custom_id"] for e in errors]
    assert sorted(answered) == sorted(valid)  # every line exactly once
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}


@pytest.mark.slow  # about 40 s on two cores
def test_f13_worker_killed_halfway_every_valid_line_exactly_once(
    oai, workers, conn, tmp_path
) -> None:
    """docs/faults.md F13 at full size: 10,000 lines, 1% invalid (11 kinds), kill -9 one
    worker's whole process tree when half the valid lines are answered; a second worker
    finishes. Every valid line is answered exactly once, every invalid one has its error
    record, and nothing was generated twice (the workers' own counters say so)."""
    doomed = workers("batch-doomed", "--max-batch", str(F13_MAX_SEQUENCES))
    survivor = workers("batch-survivor", "--max-batch", str(F13_MAX_SEQUENCES))
    valid, invalid = write_f13_input(tmp_path / "in.jsonl")
    assert (len(valid), len(invalid)) == (F13_VALID, F13_LINES - F13_VALID)
    ran = sum(1 for _, _, status in invalid.values() if status is not None)
    with open(tmp_path / "in.jsonl", "rb") as handle:
        file_id = oai.files.create(file=handle, purpose="batch").id
    batch = oai.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    counts = batch.request_counts  # lines only a worker can find invalid are not failed yet
    assert (counts.total, counts.completed, counts.failed) == (F13_LINES, 0, len(invalid) - ran)
    half = F13_VALID // 2
    wait_status(oai, batch.id, set(), 300, until=lambda b: b.request_counts.completed >= half)
    _, alive = psutil.wait_procs(doomed.kill_tree(), timeout=10)
    assert not alive  # the whole tree is gone
    batch = wait_status(oai, batch.id, {"completed", "failed"}, 300)

    errors = lines_of(oai, batch.error_file_id)
    unexpected = [e for e in errors if line_number(e, batch.id) not in invalid][:5]
    assert batch.status == "completed", (batch.status, batch.errors)
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (
        F13_LINES,
        F13_VALID,
        len(invalid),
    ), f"valid lines that failed (first 5): {unexpected}\nsurvivor:\n{survivor.output()[-3000:]}"
    assert_output_exactly_once(lines_of(oai, batch.output_file_id), batch.id, valid)
    assert_error_records(errors, batch.id, invalid)
    assert batch.usage.output_tokens == F13_VALID * F13_TOKENS
    # generations = valid lines +- 0: each result written once, each token generated once
    assert int(conn.hget(keys.METRIC_JOBS, "finished") or 0) == F13_VALID
    assert int(conn.hget(keys.METRIC_JOBS, "failed") or 0) == ran  # too long: never generated
    assert int(conn.hget(keys.METRIC_TOKENS_GENERATED, MODEL) or 0) == F13_VALID * F13_TOKENS
    # the kill hit running jobs: the survivor's reaper requeued them to resume
    assert re.search(rf"job {batch.id}-\d+ lost its worker", survivor.output())


def test_llmq_batch_submit_wait_writes_results(server, workers, tmp_path) -> None:
    workers("batch-w1")
    valid, invalid = write_input(tmp_path / "in.jsonl", 10, invalid_every=5)
    out = tmp_path / "out.jsonl"
    cli = [sys.executable, "-m", "llmq", "batch"]
    env = {**os.environ, "LLMQ_BASE_URL": server}
    done = subprocess.run(
        [*cli, "submit", str(tmp_path / "in.jsonl"), "--wait", "--poll", "0.2", "-o", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    batch_id = done.stdout.strip()
    assert batch_id.startswith("batch_")
    assert "8/10 requests" in done.stderr or "10/10 requests" in done.stderr
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == sorted(valid)
    errors = (tmp_path / "out.errors.jsonl").read_text().splitlines()
    assert {json.loads(x)["custom_id"] or "" for x in errors} == invalid
    status = subprocess.run(
        [*cli, "status", batch_id], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
    )
    assert json.loads(status.stdout)["status"] == "completed"
    results = subprocess.run(
        [*cli, "results", batch_id], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
    )
    assert results.returncode == 0 and len(results.stdout.splitlines()) == len(valid)
    assert len([x for x in results.stderr.splitlines() if x.startswith("{")]) == len(invalid)
    missing = subprocess.run(
        [*cli, "status", "batch_nope"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert missing.returncode == 1 and "404" in missing.stderr


def test_llmq_batch_submit_wait_logs_progress_when_piped(server, workers, tmp_path) -> None:
    """With stderr a pipe (a log, CI), `--wait` writes a progress line at least every
    `--progress-interval` seconds while the batch runs, not only its first and last line."""
    workers("batch-progress", step_delay_ms=250)  # 8 tokens: about 2-3 s for the batch
    lines = [json.dumps(chat_line(i)) for i in range(4)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    interval = 0.4
    argv = [sys.executable, "-m", "llmq", "batch", "submit", str(tmp_path / "in.jsonl")]
    argv += ["--wait", "--poll", "5", "--progress-interval", str(interval)]
    env = {**os.environ, "LLMQ_BASE_URL": server}
    with subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stderr is not None
        stamped = [(time.monotonic(), line) for line in proc.stderr]  # read as they come
        assert proc.wait(30) == 0, "".join(line for _, line in stamped)
    progress = [(at, line) for at, line in stamped if " requests (" in line]
    assert len(progress) >= 4, progress
    assert "4/4 requests" in progress[-1][1]
    # --poll 5 would leave gaps of 5 s; the progress interval bounds them (plus a poll's time)
    gaps = [b[0] - a[0] for a, b in zip(progress, progress[1:], strict=False)]
    assert max(gaps) < interval + 0.5, gaps


def test_a_batch_of_responses_lines_answers_with_response_objects(oai, workers, tmp_path) -> None:
    """`/v1/responses` lines run as the chat jobs they translate to: each output body is a
    Response whose text is what the same chat request answers, and the lines the Batch API
    cannot run (background, a stored conversation, a field llmq does not do) are errors."""
    workers("batch-w1")
    prompts = [f"say {i}" for i in range(3)]
    lines = [
        {
            "custom_id": f"r-{i}",
            "method": "POST",
            "url": "/v1/responses",
            "body": {
                "model": MODEL,
                "instructions": "Answer briefly.",
                "input": prompt,
                "max_output_tokens": TOKENS,
                "temperature": 0,
            },
        }
        for i, prompt in enumerate(prompts)
    ]
    refused = {
        "r-bg": {"background": True},
        "r-prev": {"previous_response_id": "resp_0123"},
        "r-reasoning": {"reasoning": {"effort": "low"}},
    }
    for custom_id, extra in refused.items():
        lines.append({**lines[0], "custom_id": custom_id, "body": {**lines[0]["body"], **extra}})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    with open(tmp_path / "in.jsonl", "rb") as handle:
        uploaded = oai.files.create(file=handle, purpose="batch")
    batch = oai.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/responses", completion_window="24h"
    )
    batch = wait_status(oai, batch.id, {"completed", "failed"}, 60)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (3, 3)
    errors = {e["custom_id"]: e["error"] for e in lines_of(oai, batch.error_file_id)}
    assert set(errors) == set(refused)
    assert "background" in errors["r-bg"]["message"]
    assert "previous_response_id" in errors["r-prev"]["message"]
    assert "reasoning" in errors["r-reasoning"]["message"]
    output = {o["custom_id"]: o["response"] for o in lines_of(oai, batch.output_file_id)}
    assert sorted(output) == ["r-0", "r-1", "r-2"]
    output_tokens = 0
    for i, prompt in enumerate(prompts):
        body = output[f"r-{i}"]["body"]
        response = openai.types.responses.Response.model_validate(body)  # the client's type
        assert response.id.startswith("resp_") and response.status in ("completed", "incomplete")
        chat = oai.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": prompt},
            ],
            max_tokens=TOKENS,
            temperature=0,
        )
        assert response.output_text and response.output_text == chat.choices[0].message.content
        assert response.usage.output_tokens == chat.usage.completion_tokens
        output_tokens += response.usage.output_tokens
    assert batch.usage.output_tokens == output_tokens
