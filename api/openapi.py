"""The `docs` blueprint: `GET /openapi.json` (OpenAPI 3.1) and `GET /docs` (Swagger UI).

The document is generated: `ROUTES` names each operation with its pydantic request and
response models, and `build_document` turns their `model_json_schema()` into paths, moving
every `$defs` entry into `components/schemas`. Swagger UI's assets come from the
`swagger-ui-bundle` package and are served here (no CDN).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from flask import Blueprint, Response, abort, jsonify, send_from_directory
from pydantic import BaseModel, Field
from swagger_ui_bundle import swagger_ui_path

from api import bodies as r
from api import webhook_bodies as wb
from api.responses.requests import ResponseRequest
from api.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from workers.wire.job import BATCH_ENDPOINTS, ENDPOINTS, JOB_STATUSES

bp = Blueprint("docs", __name__)

REF = "#/components/schemas/"
JSON, SSE, TEXT, BYTES = (
    "application/json",
    "text/event-stream",
    "text/plain",
    "application/octet-stream",
)
ASSETS = ("swagger-ui.css", "swagger-ui-bundle.js", "swagger-ui-standalone-preset.js")

# Response headers, in `components/headers`: OpenAI's rate-limit figures on every /v1
# answer but a 401 while LLMQ_RATE_LIMIT_RPM or _TPM is set (api.rate_limits), and
# Retry-After on 429 and 503.
HEADERS: dict[str, Any] = {
    "Retry-After": {
        "description": "Whole seconds to wait before retrying",
        "schema": {"type": "integer", "minimum": 1},
    },
    **{
        f"x-ratelimit-{what}-{bucket}": {"description": text.format(bucket), "schema": schema}
        for bucket in ("requests", "tokens")
        for what, text, schema in (
            ("limit", "The caller's {} per minute (when limited)", {"type": "integer"}),
            ("remaining", "The caller's {} left now (when limited)", {"type": "integer"}),
            ("reset", "Until the caller's {} are full again: `120ms`, `6m0s`", {"type": "string"}),
        )
    },
}


# ---------------------------------------------------------------- bodies parsed by hand


class JobCreate(BaseModel):
    """`POST /v1/jobs`: the endpoint to run and the body you would POST to it."""

    endpoint: Literal[ENDPOINTS]  # type: ignore[valid-type]
    body: dict[str, Any]


class BatchCreate(BaseModel):
    input_file_id: str
    endpoint: Literal[BATCH_ENDPOINTS]  # type: ignore[valid-type]
    completion_window: str = Field(description="`24h`, or any shorter `N s|m|h`")
    metadata: dict[str, str] | None = None


class FileUpload(BaseModel):
    """multipart/form-data: a JSONL file of `{custom_id, method, url, body}` lines."""

    file: bytes = Field(json_schema_extra={"format": "binary"})
    purpose: Literal["batch"]


# ---------------------------------------------------------------- the route table


@dataclass(frozen=True)
class Param:
    name: str
    where: Literal["path", "query", "header"]
    schema: dict[str, Any]
    description: str = ""


@dataclass(frozen=True)
class Op:
    method: str
    path: str  # OpenAPI's template: /v1/jobs/{job_id}
    tag: str
    summary: str
    body: type[BaseModel] | None = None
    ok: dict[int, dict[str, type[BaseModel] | None]] = field(default_factory=dict)
    errors: tuple[int, ...] = ()
    params: tuple[Param, ...] = ()
    body_type: str = JSON


JOB_ID = Param("job_id", "path", {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"})
RESPONSE_ID = Param(
    "response_id", "path", {"type": "string", "pattern": "^resp_[A-Za-z0-9_-]{1,59}$"}
)
LIMIT_100 = Param("limit", "query", {"type": "integer", "minimum": 1, "maximum": 100})
AFTER = Param("after", "query", {"type": "string"}, "the id after which the page starts")
PREFER = Param("Prefer", "header", {"type": "string"}, "`respond-async`: answer 202 with a job")
LAST_EVENT_ID = Param("Last-Event-ID", "header", {"type": "string"}, "resume after this event")
V1_ERRORS = (400, 401, 404, 413, 429, 503)  # every /v1 operation can also be refused


def _generate(path: str, tag: str, summary: str, body: type[BaseModel], result: Any) -> Op:
    ok = {200: {JSON: result, SSE: None}, 202: {JSON: r.JobSummary}}
    return Op("post", path, tag, summary, body, ok, V1_ERRORS, (PREFER,))


ROUTES: tuple[Op, ...] = (
    _generate("/v1/completions", "openai", "Complete a prompt", CompletionRequest, r.Completion),
    _generate(
        "/v1/chat/completions", "openai", "Answer a chat", ChatCompletionRequest, r.ChatCompletion
    ),
    _generate("/v1/embeddings", "openai", "Embed texts", EmbeddingRequest, r.EmbeddingList),
    Op("get", "/v1/models", "openai", "List models", ok={200: {JSON: r.ModelList}}),
    Op(
        "get",
        "/v1/models/{model_id}",
        "openai",
        "Retrieve a model",
        ok={200: {JSON: r.ModelObject}},
        errors=(404,),
    ),
    # OpenAI's Responses API (api/responses/routes.py)
    Op(
        "post",
        "/v1/responses",
        "responses",
        "Create a response (SSE with stream; at once with background)",
        ResponseRequest,
        {200: {JSON: r.ResponseObject, SSE: None}},
        V1_ERRORS,
    ),
    Op(
        "get",
        "/v1/responses/{response_id}",
        "responses",
        "Retrieve a response, or stream its events after starting_after",
        ok={200: {JSON: r.ResponseObject, SSE: None}},
        errors=(400, 404),
        params=(
            RESPONSE_ID,
            Param("stream", "query", {"type": "boolean"}),
            Param("starting_after", "query", {"type": "integer", "minimum": -1}),
        ),
    ),
    Op(
        "post",
        "/v1/responses/{response_id}/cancel",
        "responses",
        "Cancel a background response",
        ok={200: {JSON: r.ResponseObject}},
        errors=(400, 404),
        params=(RESPONSE_ID,),
    ),
    Op(
        "delete",
        "/v1/responses/{response_id}",
        "responses",
        "Delete a stored response",
        ok={200: {JSON: r.ResponseDeleted}},
        errors=(404, 409),
        params=(RESPONSE_ID,),
    ),
    Op(
        "get",
        "/v1/responses/{response_id}/input_items",
        "responses",
        "A response's input items",
        ok={200: {JSON: r.ResponseItemList}},
        errors=(400, 404),
        params=(
            RESPONSE_ID,
            LIMIT_100,
            AFTER,
            Param("order", "query", {"type": "string", "enum": ["asc", "desc"]}),
        ),
    ),
    Op(
        "post",
        "/v1/jobs",
        "jobs",
        "Submit an async job",
        JobCreate,
        {202: {JSON: r.JobSummary}},
        (429,),
    ),
    Op(
        "get",
        "/v1/jobs",
        "jobs",
        "List your jobs, newest first",
        ok={200: {JSON: r.JobList}},
        params=(
            LIMIT_100,
            AFTER,
            Param("status", "query", {"type": "string", "enum": list(JOB_STATUSES)}),
        ),
    ),
    Op("get", "/v1/jobs/{job_id}", "jobs", "Poll a job", ok={200: {JSON: r.Job}}, params=(JOB_ID,)),
    Op(
        "post",
        "/v1/jobs/{job_id}/cancel",
        "jobs",
        "Cancel a job",
        ok={202: {JSON: r.Job}},
        errors=(409,),
        params=(JOB_ID,),
    ),
    Op(
        "get",
        "/v1/jobs/{job_id}/events",
        "jobs",
        "Follow a job's tokens (SSE; resumable)",
        ok={200: {SSE: None}},
        params=(JOB_ID, LAST_EVENT_ID, Param("after", "query", {"type": "string"})),
    ),
    Op(
        "post",
        "/v1/files",
        "batches",
        "Upload a batch input file",
        FileUpload,
        {200: {JSON: r.FileObject}},
        (413, 415),
        body_type="multipart/form-data",
    ),
    Op(
        "get",
        "/v1/files",
        "batches",
        "List files",
        ok={200: {JSON: r.FileList}},
        params=(
            Param("limit", "query", {"type": "integer", "minimum": 1, "maximum": 10_000}),
            AFTER,
            Param("order", "query", {"type": "string", "enum": ["asc", "desc"]}),
            Param("purpose", "query", {"type": "string"}),
        ),
    ),
    Op(
        "get",
        "/v1/files/{file_id}",
        "batches",
        "Retrieve a file",
        ok={200: {JSON: r.FileObject}},
    ),
    Op(
        "delete",
        "/v1/files/{file_id}",
        "batches",
        "Delete a file",
        ok={200: {JSON: r.FileDeleted}},
    ),
    Op(
        "get",
        "/v1/files/{file_id}/content",
        "batches",
        "A file's bytes",
        ok={200: {BYTES: None}},
    ),
    Op(
        "post",
        "/v1/batches",
        "batches",
        "Create a batch",
        BatchCreate,
        {200: {JSON: r.Batch}},
        (429,),
    ),
    Op(
        "get",
        "/v1/batches",
        "batches",
        "List batches",
        ok={200: {JSON: r.BatchList}},
        params=(LIMIT_100, AFTER),
    ),
    Op(
        "get",
        "/v1/batches/{batch_id}",
        "batches",
        "Retrieve a batch",
        ok={200: {JSON: r.Batch}},
    ),
    Op(
        "post",
        "/v1/batches/{batch_id}/cancel",
        "batches",
        "Cancel a batch",
        ok={200: {JSON: r.Batch}},
    ),
    Op("get", "/admin/workers", "admin", "Workers", ok={200: {JSON: r.WorkerList}}),
    Op("get", "/admin/jobs", "admin", "Jobs in flight", ok={200: {JSON: r.RunningJobList}}),
    Op("get", "/admin/models", "admin", "Model pools", ok={200: {JSON: r.ModelPoolList}}),
    Op("get", "/admin/queues", "admin", "Queues", ok={200: {JSON: r.QueueList}}),
    Op(
        "get",
        "/admin/history",
        "admin",
        "The last minutes of throughput, queue depth, running jobs and TTFT",
        ok={200: {JSON: r.History}},
    ),
    Op(
        "post",
        "/admin/models/load",
        "admin",
        "Load a model on the live workers",
        r.ModelCommand,
        {202: {JSON: r.ModelCommandSent}},
        (404, 503),
    ),
    Op(
        "post",
        "/admin/models/unload",
        "admin",
        "Unload a model from the workers holding it",
        r.ModelCommand,
        {202: {JSON: r.ModelCommandSent}},
        (404, 503),
    ),
    Op("get", "/admin/loras", "admin", "LoRA adapters", ok={200: {JSON: r.LoraList}}),
    Op(
        "post",
        "/admin/loras",
        "admin",
        "Register a LoRA adapter on every worker serving its base model",
        r.LoraRegistration,
        {201: {JSON: r.Lora}, 202: {JSON: r.Lora}},
        (400, 404),
    ),
    Op(
        "delete",
        "/admin/loras/{name}",
        "admin",
        "Unregister a LoRA adapter",
        ok={200: {JSON: r.LoraDeleted}},
        errors=(404,),
    ),
    # webhooks (api/admin.py; bodies in api/webhook_bodies.py)
    Op(
        "post",
        "/admin/webhooks",
        "admin",
        "Add a webhook endpoint (its secret is shown only here)",
        wb.WebhookCreate,
        {201: {JSON: wb.WebhookEndpointCreated}},
    ),
    Op(
        "get",
        "/admin/webhooks",
        "admin",
        "Webhook endpoints",
        ok={200: {JSON: wb.WebhookEndpointList}},
    ),
    Op(
        "delete",
        "/admin/webhooks/{endpoint_id}",
        "admin",
        "Remove a webhook endpoint",
        ok={200: {JSON: wb.WebhookEndpointDeleted}},
        errors=(404,),
    ),
    Op(
        "get",
        "/admin/webhooks/{endpoint_id}/deliveries",
        "admin",
        "An endpoint's last delivery attempts, newest first",
        ok={200: {JSON: wb.WebhookDeliveryList}},
        errors=(404,),
    ),
    Op(
        "get",
        "/admin/webhooks/dead",
        "admin",
        "Deliveries that failed their last attempt",
        ok={200: {JSON: wb.DeadDeliveryList}},
    ),
    Op(
        "post",
        "/admin/webhooks/dead/{delivery}/redeliver",
        "admin",
        "Send a dead delivery again, with its whole retry schedule",
        ok={202: {JSON: wb.Redelivered}},
        errors=(404,),
    ),
    Op("get", "/health", "ops", "Liveness", ok={200: {JSON: r.Health}}),
    Op("get", "/ready", "ops", "Readiness", ok={200: {JSON: r.Ready}}, errors=(503,)),
    Op("get", "/metrics", "ops", "Prometheus metrics", ok={200: {TEXT: None}}),
    Op("get", "/openapi.json", "ops", "This document", ok={200: {JSON: None}}),
)


# ---------------------------------------------------------------- the builder


class _Components:
    """Collects schemas: each model once under its name, its `$defs` beside it."""

    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}

    def ref(self, model: type[BaseModel]) -> dict[str, str]:
        if model.__name__ not in self.schemas:
            schema = model.model_json_schema(ref_template=REF + "{model}")
            self.schemas.update(schema.pop("$defs", {}))
            self.schemas[model.__name__] = schema
        return {"$ref": REF + model.__name__}


def _content(components: _Components, media: dict[str, type[BaseModel] | None]) -> dict[str, Any]:
    content = {}
    for media_type, model in media.items():
        schema = components.ref(model) if model else {"type": "string"}
        content[media_type] = {"schema": schema}
    return content


def _parameters(op: Op) -> list[Param]:
    """The op's parameters: a plain string for each `{name}` of its path it does not declare
    (so the route table never forgets one), then those it declares (`JOB_ID`, queries)."""
    declared = {p.name for p in op.params}
    names = [n for n in re.findall(r"{(\w+)}", op.path) if n not in declared]
    return [*(Param(n, "path", {"type": "string"}) for n in names), *op.params]


def _operation(op: Op, components: _Components) -> dict[str, Any]:
    responses: dict[str, Any] = {
        str(status): {"description": "OK", "content": _content(components, media)}
        for status, media in op.ok.items()
    }
    error = {"content": {JSON: {"schema": components.ref(r.ErrorBody)}}}
    statuses = set(op.errors) | {400, 500}
    if op.path.startswith("/v1"):
        statuses |= {401, 404, 503}
    elif op.path.startswith("/admin"):
        statuses |= {403, 503}
    for status in sorted(statuses):
        responses[str(status)] = {"description": _REASONS.get(status, "Error"), **error}
    for status, response in responses.items():
        names = [n for n in HEADERS if n.startswith("x-") and op.path.startswith("/v1")]
        names = [] if status == "401" else names
        if status in ("429", "503"):
            names.insert(0, "Retry-After")
        if names:
            response["headers"] = {n: {"$ref": f"#/components/headers/{n}"} for n in names}
    operation: dict[str, Any] = {
        "operationId": f"{op.method}_{re.sub(r'[^A-Za-z0-9]+', '_', op.path).strip('_')}",
        "tags": [op.tag],
        "summary": op.summary,
        "responses": responses,
    }
    params = _parameters(op)
    if params:
        operation["parameters"] = [
            {
                "name": p.name,
                "in": p.where,
                "required": p.where == "path",
                "schema": p.schema,
                **({"description": p.description} if p.description else {}),
            }
            for p in params
        ]
    if op.body is not None:
        body_content = {op.body_type: {"schema": components.ref(op.body)}}
        operation["requestBody"] = {"required": True, "content": body_content}
    return operation


_REASONS = {
    400: "Invalid request",
    401: "Missing or wrong API key",
    403: "Not allowed",
    404: "Not found",
    409: "Conflict (the job has already ended)",
    413: "Body too large",
    415: "Unsupported media type",
    429: (
        "Queue full, or the caller's rate limit reached (`error.type` requests or tokens, "
        "code rate_limit_exceeded); see Retry-After"
    ),
    500: "Internal error (a bug: never expected)",
    501: "Not implemented yet",
    503: "Broker or workers unavailable (see Retry-After)",
}


@functools.cache
def build_document() -> dict[str, Any]:
    """The whole OpenAPI 3.1 document from `ROUTES` (built once per process)."""
    components = _Components()
    paths: dict[str, dict[str, Any]] = {}
    for op in ROUTES:
        paths.setdefault(op.path, {})[op.method] = _operation(op, components)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "llmq",
            "version": "0.1.0",
            "description": "OpenAI-compatible LLM serving over a Redis job queue.",
        },
        "servers": [{"url": "/"}],
        "paths": paths,
        "components": {
            "schemas": components.schemas,
            "headers": HEADERS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{}, {"bearer": []}],
    }


@bp.get("/openapi.json")
def openapi_json() -> Response:
    return jsonify(build_document())


DOCS_PAGE = """<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>llmq API</title>
  <link rel="stylesheet" href="/docs/assets/swagger-ui.css">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="/docs/assets/swagger-ui-bundle.js"></script>
  <script src="/docs/assets/swagger-ui-standalone-preset.js"></script>
  <script src="/docs/assets/init.js"></script>
</body>
</html>
"""

INIT_JS = """window.ui = SwaggerUIBundle({
  url: "/openapi.json",
  dom_id: "#swagger-ui",
  presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset],
  layout: "StandaloneLayout",
});
"""


@bp.get("/docs")
def docs() -> Response:
    return Response(DOCS_PAGE, mimetype="text/html")


@bp.get("/docs/assets/<name>")
def docs_asset(name: str) -> Response:
    if name == "init.js":  # a file, not inline: a strict Content-Security-Policy allows it
        return Response(INIT_JS, mimetype="text/javascript")
    if name not in ASSETS:
        abort(404)
    return send_from_directory(str(swagger_ui_path), name, max_age=3600)
