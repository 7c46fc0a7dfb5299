"""GET /openapi.json (OpenAPI 3.1, generated from the pydantic models) and GET /docs."""

from __future__ import annotations

import json
import re
import time
from collections import namedtuple
from dataclasses import fields
from types import SimpleNamespace
from typing import Any

from openapi_spec_validator import validate
from openapi_spec_validator.validation.exceptions import OpenAPIValidationError
from pydantic import BaseModel

from api import admin
from api.bodies import Completion, Job, WorkerList
from api.openapi import JSON, ROUTES
from workers import keys
from workers.history import HistorySampler
from workers.pool import PoolEntry
from workers.wire.loras import register
from workers.wire.worker_info import READY, WorkerInfo

ASYNC = {"Prefer": "respond-async"}
DOCUMENTED_PREFIXES = ("/v1", "/admin", "/health", "/ready", "/metrics", "/openapi.json")


def _flask_routes(app) -> set[tuple[str, str]]:
    routes = set()
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:[a-z]+:)?([a-z_]+)>", r"{\1}", rule.rule)
        if not path.startswith(DOCUMENTED_PREFIXES):
            continue
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            routes.add((method.lower(), path))
    return routes


def test_document_is_valid_openapi_31(client) -> None:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    document = response.get_json()
    assert document["openapi"].startswith("3.1")
    validate(document)  # raises on any violation of the 3.1 schema


def test_validator_does_refuse_a_broken_document(client) -> None:
    """The check above can fail: a path with an undeclared parameter is refused."""
    document = client.get("/openapi.json").get_json()
    document["paths"]["/v1/jobs/{job_id}"]["get"].pop("parameters")
    try:
        validate(document)
    except OpenAPIValidationError:
        return
    raise AssertionError("openapi-spec-validator accepted a path without its parameter")


def test_every_route_of_the_app_is_documented(app, client) -> None:
    document = client.get("/openapi.json").get_json()
    documented = {(m, p) for p, ops in document["paths"].items() for m in ops}
    served = _flask_routes(app)
    assert served - documented == set(), "routes the document misses"
    assert documented - served == set(), "operations the app does not serve"
    assert len(documented) == len(ROUTES)


def test_schemas_come_from_the_pydantic_models(client) -> None:
    document = client.get("/openapi.json").get_json()
    schemas = document["components"]["schemas"]
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"
    }
    # nested models ($defs) moved into components, and every $ref resolves
    assert "ChatMessage" in schemas and "Tool" in schemas
    text = str(document)
    for name in re.findall(r"#/components/schemas/([A-Za-z0-9_]+)", text):
        assert name in schemas, name
    assert "$defs" not in text
    assert schemas["Job"]["properties"]["status"] == Job.model_json_schema()["properties"]["status"]
    assert set(Completion.model_fields) <= set(schemas["Completion"]["properties"])
    job = document["paths"]["/v1/jobs/{job_id}"]["get"]["responses"]
    assert job["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/Job")
    assert job["404"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")


def test_admin_workers_documents_each_workers_device(client) -> None:
    """The body /admin/workers serves is what the document says, device included."""
    document = client.get("/openapi.json").get_json()
    schemas = document["components"]["schemas"]
    workers = document["paths"]["/admin/workers"]["get"]["responses"]["200"]
    assert workers["content"]["application/json"]["schema"]["$ref"].endswith("/WorkerList")
    assert "device" in schemas["WorkerObject"]["required"]
    assert "device" in schemas["PoolEntryState"]["properties"]
    served = WorkerList.model_validate(client.get("/admin/workers").get_json())
    assert served.data[0].device == "cpu"


_Bucket = namedtuple("_Bucket", ["rows", "lora"])  # runtime/models/static_decode.py's


class _PrefixCache:
    stats = SimpleNamespace(queries=3, hits=1, prompt_tokens=30, cached_tokens=16, hit_rate=0.5)

    def __len__(self) -> int:
        return 2


def _loaded_entry() -> PoolEntry:
    """A ready pool entry with everything `PoolEntry.describe` can publish: backend, kernels,
    KV pool, prefix cache, and adapters loaded, failed and named by a registry."""
    engine = SimpleNamespace(
        backend=SimpleNamespace(name="torch"),
        model=SimpleNamespace(weight_kinds=lambda: {"int4": 3, "int8": 1}),
        kv_pool=SimpleNamespace(bytes_in_use=2**20, n_blocks=64, block_nbytes=2**16),
        prefix_cache=_PrefixCache(),
        decode_graphs=SimpleNamespace(
            graphs={_Bucket(1, 0): None, _Bucket(1, 1): None},  # one with LoRA rows
            buckets=[1, 2, 3],
            graph_bytes=2**21,
            capture_seconds=0.5,
        ),
        lora_slots=SimpleNamespace(count=8, resident={"style#1": 0}, nbytes=2**20),
    )
    loras = {
        "style": {"state": "ready", "path": "style.gguf", "memory_mb": 0.25},
        "bad": {"state": "failed", "path": "bad.gguf", "error": "not a LoRA file"},
        "reg": {"state": "ready", "source": "registry"},
    }
    return PoolEntry(
        "tiny", READY, engine, memory_bytes=2**24, load_seconds=0.5, loaded_at=1.0, loras=loras
    )


def _extras(value: Any, where: str = "") -> list[str]:
    """Every field a parsed body carries that its model does not document."""
    if isinstance(value, BaseModel):
        found = [f"{where}.{name}" for name in value.model_extra or {}]
        for name in type(value).model_fields:
            found += _extras(getattr(value, name), f"{where}.{name}")
        return found
    if isinstance(value, dict):
        return [e for key, item in value.items() for e in _extras(item, f"{where}[{key}]")]
    if isinstance(value, list):
        return [e for i, item in enumerate(value) for e in _extras(item, f"{where}[{i}]")]
    return []


def _check_documented(method: str, path: str, response) -> None:
    """The body is what `/openapi.json` says for its status: it validates against that
    model, has no undocumented field, and the model writes it back key for key, in order."""
    [op] = [op for op in ROUTES if (op.method, op.path) == (method, path)]
    model = op.ok[response.status_code][JSON]
    body = response.get_json()
    parsed = model.model_validate(body)
    assert _extras(parsed) == [], path
    assert json.dumps(parsed.dump()) == json.dumps(body), path


def test_admin_and_ops_bodies_are_their_documented_models(
    client, fake_redis, registered, monkeypatch
) -> None:
    """Every admin and ops body, with each of its lists non-empty and a pool entry in full."""
    job = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}, headers=ASYNC)
    registered.info.pool = {"tiny": _loaded_entry().describe(), "big": PoolEntry("big").describe()}
    registered.info.current_jobs = [job.get_json()["id"]]
    registered.register()
    fake_redis.hset(keys.MODELS, "tiny", json.dumps({"context_length": 64, "loras": ["reg"]}))
    register(fake_redis, "style", "style.gguf", "tiny")
    for seconds_ago in (10, 5):  # two samples: every field of a point has a value
        HistorySampler(fake_redis).sample(time.time() - seconds_ago)
    for path in (
        "/admin/workers",
        "/admin/jobs",
        "/admin/models",
        "/admin/queues",
        "/admin/loras",
        "/admin/history",
    ):
        response = client.get(path)
        assert response.status_code == 200 and response.get_json()["data"], path
        _check_documented("get", path, response)
    for path in ("/health", "/ready"):
        _check_documented("get", path, client.get(path))
    for path in ("/admin/models/load", "/admin/models/unload"):
        _check_documented("post", path, client.post(path, json={"model": "tiny"}))
    monkeypatch.setattr(admin, "_check_adapter", lambda path, base_model: path)
    client.application.config["LORA_WAIT_SECONDS"] = 0  # the fake worker loads nothing
    added = client.post("/admin/loras", json={"name": "x", "path": "x.gguf", "base_model": "tiny"})
    _check_documented("post", "/admin/loras", added)
    _check_documented("delete", "/admin/loras/{name}", client.delete("/admin/loras/x"))


def test_admin_bodies_keep_the_key_order_of_what_they_show(client, registered) -> None:
    """A worker in `WorkerInfo`'s field order then `alive`; a pool entry in
    `PoolEntry.describe`'s order: the models follow their sources, not the other way."""
    entry = _loaded_entry().describe()
    registered.info.pool = {"tiny": entry}
    registered.register()
    [worker] = client.get("/admin/workers").get_json()["data"]
    assert list(worker) == [f.name for f in fields(WorkerInfo)] + ["alive"]
    assert list(worker["pool"]["tiny"]) == list(entry)
    assert json.dumps(worker["pool"]["tiny"]) == json.dumps(entry)
    [model] = client.get("/admin/models").get_json()["data"]
    assert json.dumps(model["pools"]["fake-1"]) == json.dumps(entry)


def test_docs_page_and_its_assets_are_served_locally(client) -> None:
    page = client.get("/docs")
    assert page.status_code == 200 and page.mimetype == "text/html"
    html = page.get_data(as_text=True)
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert len(assets) == 4
    for asset in assets:
        assert asset.startswith("/docs/assets/"), f"{asset} is not served by the app"
        with client.get(asset) as response:  # a served file: closed when read
            assert response.status_code == 200, asset
            assert len(response.get_data()) > 0
    with client.get("/docs/assets/swagger-ui-bundle.js") as response:
        assert "SwaggerUIBundle" in response.get_data(as_text=True)
    assert "/openapi.json" in client.get("/docs/assets/init.js").get_data(as_text=True)
    assert client.get("/docs/assets/..%2Fsecret").status_code == 404
    assert client.get("/docs/assets/index.html").status_code == 404
