"""LoRA adapters through the API (fakeredis, a fake worker): `/admin/loras` registers,
lists and deletes adapters, refusing paths outside LLMQ_ADAPTER_DIR and adapters that do
not fit the base model, and answers once a worker reports the adapter loaded (201), when
none can yet (202), or when every worker failed to load it (400, withdrawn); a request's
`lora`, or a `model` naming an adapter, reaches the job's spec, and an unknown adapter is a
404 at submission."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import fakeredis
import pytest

from api.app import create_app
from api.batches.lines import validate_lines
from tests.api.fake_worker import FakeWorker
from tests.tiny_models import write_lora, write_tiny_gemma3, write_tiny_llama
from workers import keys
from workers.wire.commands import decode_command
from workers.wire.job import JobRecord
from workers.wire.loras import read_entry

ASYNC = {"Prefer": "respond-async"}
WAIT = 0.3  # LORA_WAIT_SECONDS here: the fake worker loads nothing unless told to


@pytest.fixture
def adapter_dir(tmp_path: Path, monkeypatch) -> Path:
    """LLMQ_ADAPTER_DIR with `style.gguf` for the tiny llama (registered as model "tiny")
    and `gemma.gguf` for another architecture."""
    base = write_tiny_llama(tmp_path / "tiny.gguf")
    registry = tmp_path / "models.toml"
    registry.write_text(f'[models.tiny]\npath = "{base}"\n')
    monkeypatch.setenv("LLMQ_MODELS", str(registry))
    folder = tmp_path / "adapters"
    folder.mkdir()
    write_lora(folder / "style.gguf", base)
    write_lora(folder / "gemma.gguf", write_tiny_gemma3(tmp_path / "gemma.gguf"))
    (folder / "escape.gguf").symlink_to(write_lora(tmp_path / "outside.gguf", base))
    monkeypatch.setenv("LLMQ_ADAPTER_DIR", str(folder))
    return folder


@pytest.fixture
def fake(fake_redis: fakeredis.FakeRedis) -> FakeWorker:
    return FakeWorker(fake_redis).register()


@pytest.fixture
def client(fake_redis: fakeredis.FakeRedis, fake: FakeWorker, adapter_dir: Path):
    config = {"TESTING": True, "REDIS_CLIENT": fake_redis, "LORA_WAIT_SECONDS": WAIT}
    return create_app(config).test_client()


def obey_adapters(fake: FakeWorker, outcome: str, error: str = "") -> threading.Thread:
    """In a thread, as a real worker does: take the `adapters` command from the fake
    worker's command list, then publish the registered adapters' `outcome` in its pool."""

    def run() -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            raw = fake.conn.lpop(keys.worker_commands(fake.info.name))
            if raw is None:
                time.sleep(0.01)
                continue
            op, model = decode_command(raw)
            assert op == "adapters"
            for name, entry in {
                k.decode(): json.loads(v) for k, v in fake.conn.hgetall(keys.LORAS).items()
            }.items():
                state = {"state": outcome, "path": entry["path"]}
                state |= {"registered_at": entry["registered_at"], "error": error or None}
                fake.info.pool[model].setdefault("loras", {})[name] = state
            fake._heartbeat()
            return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def add(client, name: str = "style", path: str = "style.gguf", base: str = "tiny"):
    return client.post("/admin/loras", json={"name": name, "path": path, "base_model": base})


def job_record(fake_redis, response) -> JobRecord:
    assert response.status_code == 202, response.get_json()
    return JobRecord.from_hash(fake_redis.hgetall(keys.job(response.get_json()["id"])))


def test_register_list_and_delete(client, fake_redis):
    started = time.monotonic()
    response = add(client)  # the fake worker never loads it: pending when the wait ends
    assert time.monotonic() - started >= WAIT
    assert response.status_code == 202, response.get_json()
    body = response.get_json()
    assert body["base_model"] == "tiny" and body["state"] == "pending"
    assert body["workers"] == {"fake-1": {"state": "pending"}}
    [command] = fake_redis.lrange(keys.worker_commands("fake-1"), 0, -1)
    assert decode_command(command) == ("adapters", "tiny")  # told at once, not at a heartbeat
    [listed] = client.get("/admin/loras").get_json()["data"]
    assert listed["name"] == "style" and listed["path"] == "style.gguf"
    assert listed["state"] == "pending"
    assert listed["workers"] == {"fake-1": {"state": "pending"}}  # not loaded there yet
    assert client.delete("/admin/loras/style").status_code == 200
    assert fake_redis.llen(keys.worker_commands("fake-1")) == 2  # and told to unload it now
    assert client.get("/admin/loras").get_json()["data"] == []
    assert client.delete("/admin/loras/style").status_code == 404


def test_registration_answers_once_a_worker_reports_it_loaded(fake_redis, fake, adapter_dir):
    config = {"TESTING": True, "REDIS_CLIENT": fake_redis, "LORA_WAIT_SECONDS": 10}
    client = create_app(config).test_client()
    reporter = obey_adapters(fake, "ready")
    started = time.monotonic()
    response = add(client)
    assert time.monotonic() - started < 5  # on the report, not at the end of the wait
    reporter.join()
    assert response.status_code == 201, response.get_json()
    body = response.get_json()
    assert body["state"] == "ready" and body["workers"]["fake-1"]["state"] == "ready"
    assert body["workers"]["fake-1"]["registered_at"] == body["registered_at"]
    [listed] = client.get("/admin/loras").get_json()["data"]
    assert listed["state"] == "ready"


def test_a_state_about_an_earlier_registration_is_pending(client, fake_redis, fake):
    reporter = obey_adapters(fake, "ready")
    assert add(client).status_code == 201
    reporter.join()
    response = add(client)  # registered again: the worker's "ready" is about the first one
    assert response.status_code == 202, response.get_json()
    assert response.get_json()["workers"] == {"fake-1": {"state": "pending"}}


def test_an_adapter_every_worker_fails_to_load_is_withdrawn(client, fake_redis, fake):
    reporter = obey_adapters(fake, "ready")
    first = add(client).get_json()
    reporter.join()
    reporter = obey_adapters(fake, "failed", error="no adapter file 'style.gguf' there")
    response = add(client)
    reporter.join()
    assert response.status_code == 400, response.get_json()
    error = response.get_json()["error"]
    assert error["param"] == "path"
    assert "worker fake-1: no adapter file 'style.gguf' there" in error["message"]
    # the registration before it is back, and the workers are told
    assert read_entry(fake_redis, "style")["registered_at"] == first["registered_at"]
    [command] = fake_redis.lrange(keys.worker_commands("fake-1"), 0, -1)
    assert decode_command(command) == ("adapters", "tiny")
    fake_redis.delete(keys.LORAS, keys.worker_commands("fake-1"))
    obey_adapters(fake, "failed", error="bad")
    assert add(client).status_code == 400
    assert not fake_redis.exists(keys.LORAS)  # a first registration that failed: gone


def test_with_no_worker_holding_the_base_model_it_is_pending_at_once(fake_redis, fake, adapter_dir):
    fake.info.pool = {}  # serves "tiny", has not loaded it
    fake._heartbeat()
    config = {"TESTING": True, "REDIS_CLIENT": fake_redis, "LORA_WAIT_SECONDS": 10}
    started = time.monotonic()
    response = add(create_app(config).test_client())
    assert time.monotonic() - started < 5
    assert response.status_code == 202, response.get_json()
    assert response.get_json()["state"] == "pending" and response.get_json()["workers"] == {}
    assert fake_redis.llen(keys.worker_commands("fake-1")) == 1  # told all the same


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"path": "../tiny.gguf"}, 400, "path", "leads out of"),
        ({"path": "/etc/passwd"}, 400, "path", "leads out of"),
        ({"path": "escape.gguf"}, 400, "path", "leads out of"),  # a symlink out of it
        ({"path": "https://example.com/a.gguf"}, 400, "path", "must be a file path inside"),
        ({"path": "missing.gguf"}, 400, "path", "no adapter file"),
        ({"path": "gemma.gguf"}, 400, "path", "architecture 'gemma3'"),
        ({"base_model": "nope"}, 404, "model", "does not exist"),
        ({"name": "tiny"}, 400, "name", "is a model id"),
        ({"name": "a/b"}, 400, "name", "must be an id"),
        ({"extra": 1}, 400, "extra", "Unrecognized"),
    ],
)
def test_bad_registrations_are_refused(client, fake_redis, body, status, param, words):
    fields = {"name": "style", "path": "style.gguf", "base_model": "tiny", **body}
    response = client.post("/admin/loras", json=fields)
    assert response.status_code == status, response.get_json()
    error = response.get_json()["error"]
    assert error["param"] == param and words in error["message"]
    assert not fake_redis.exists(keys.LORAS)


@pytest.mark.parametrize("given", ["absolute", "dotted", "linked"])
def test_a_path_inside_the_folder_is_accepted_and_stored_relative(
    client, fake_redis, adapter_dir, given
):
    path = {
        "absolute": str(adapter_dir / "style.gguf"),
        "dotted": "./sub/../style.gguf",
        "linked": str(adapter_dir / "link.gguf"),
    }[given]
    (adapter_dir / "sub").mkdir()
    (adapter_dir / "link.gguf").symlink_to(adapter_dir / "style.gguf")
    response = add(client, path=path)
    assert response.status_code == 202, response.get_json()  # registered, loaded nowhere yet
    assert response.get_json()["path"] == "style.gguf"
    stored = json.loads(fake_redis.hget(keys.LORAS, "style"))
    assert stored["path"] == "style.gguf"


def test_a_request_lora_reaches_the_job_spec(client, fake_redis):
    add(client)
    body = {"model": "tiny", "prompt": "hi", "lora": [{"name": "style", "scale": 0.5}]}
    record = job_record(fake_redis, client.post("/v1/completions", json=body, headers=ASYNC))
    assert record.spec["adapters"] == [{"name": "style", "scale": 0.5}]
    assert record.model == "tiny"


def test_a_model_naming_an_adapter_runs_its_base_model_with_it(client, fake_redis):
    add(client)
    chat = {"model": "style", "messages": [{"role": "user", "content": "hi"}]}
    record = job_record(fake_redis, client.post("/v1/chat/completions", json=chat, headers=ASYNC))
    assert record.model == "tiny"
    assert record.spec["adapters"] == [{"name": "style", "scale": 1.0}]


def test_adapters_named_in_a_workers_registry_are_known(client, fake_redis):
    info = json.loads(fake_redis.hget(keys.MODELS, "tiny"))
    fake_redis.hset(keys.MODELS, "tiny", json.dumps({**info, "loras": ["fixed"]}))
    body = {"model": "tiny", "prompt": "hi", "lora": [{"name": "fixed"}]}
    record = job_record(fake_redis, client.post("/v1/completions", json=body, headers=ASYNC))
    assert record.spec["adapters"] == [{"name": "fixed", "scale": 1.0}]


@pytest.mark.parametrize(
    ("lora", "status"),
    [
        ([{"name": "nope"}], 404),
        ([{"name": "style"}, {"name": "nope", "scale": 2}], 404),
        ([{"name": "style", "scale": "big"}], 400),
        ("style", 400),
    ],
)
def test_unknown_or_malformed_adapters_are_refused_at_submission(client, fake_redis, lora, status):
    add(client)
    body = {"model": "tiny", "prompt": "hi", "lora": lora}
    response = client.post("/v1/completions", json=body, headers=ASYNC)
    assert response.status_code == status, response.get_json()
    assert response.get_json()["error"]["param"] == "lora"
    if status == 404:
        assert response.get_json()["error"]["code"] == "adapter_not_found"


def test_batch_lines_carry_adapters_and_refuse_unknown_ones():
    def line(custom_id: str, **body) -> str:
        request = {"model": "tiny", "prompt": "hi", **body}
        return json.dumps(
            {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": request}
        )

    content = "\n".join(
        [
            line("a", lora=[{"name": "style", "scale": 0.5}]),
            line("b", model="style"),
            line("c", lora=[{"name": "nope"}]),
        ]
    ).encode()
    valid, invalid = validate_lines(
        content, "/v1/completions", {"tiny": {}}, None, {"style": "tiny"}
    )
    assert [v.spec["adapters"] for v in valid] == [
        [{"name": "style", "scale": 0.5}],
        [{"name": "style", "scale": 1.0}],
    ]
    assert [v.model for v in valid] == ["tiny", "tiny"]
    [bad] = invalid
    assert bad.custom_id == "c" and bad.code == "adapter_not_found"


def test_models_lists_adapters_with_their_parent(client):
    add(client)
    listed = {m["id"]: m for m in client.get("/v1/models").get_json()["data"]}
    assert listed["style"]["parent"] == "tiny" and listed["style"]["ready"] is True
    assert client.get("/v1/models/style").get_json()["parent"] == "tiny"
    assert client.get("/v1/models/nope").status_code == 404
