"""The `admin` blueprint: model pools, workers, queues; load/unload commands for workers.

Guarded by `require_admin` (admin key, or loopback only). Model ids in load/unload must be
ids the workers published in `keys.MODELS`: the API never forwards paths or URLs, so a
worker is never asked to open a file the registry does not name (docs/faults.md M30).
"""

from __future__ import annotations

import re
from dataclasses import asdict
from typing import Any

from flask import Blueprint, Response, current_app, jsonify
from rq.registry import (
    CanceledJobRegistry,
    DeferredJobRegistry,
    FailedJobRegistry,
    FinishedJobRegistry,
    ScheduledJobRegistry,
    StartedJobRegistry,
)

from api import loras, store
from api import webhook_bodies as wb
from api.auth import require_admin
from api.bodies import (
    BrokerState,
    History,
    HistoryPoint,
    Lora,
    LoraDeleted,
    LoraList,
    ModelCommandSent,
    ModelPool,
    ModelPoolList,
    QueueList,
    QueueObject,
    RunningJob,
    RunningJobList,
    WorkerList,
    WorkerObject,
)
from api.body import json_object
from api.config import redis_conn
from api.errors import InvalidRequest, ModelNotFound, NotFound, ServiceUnavailable
from api.history import points, read_samples
from api.lora_rollout import FAILED, READY, AdapterRollout, adapter_states
from runtime.errors import LLMQRuntimeError
from runtime.gguf_file import GGUFFile
from runtime.lora import adapter_file, adapter_path_in_dir, check_adapter
from runtime.registry import resolve as resolve_model
from workers import keys
from workers.wire import webhook_jobs, webhooks
from workers.wire.broker import replication_state
from workers.wire.commands import COMMAND_LOAD, COMMAND_UNLOAD, push_command
from workers.wire.defaults import HISTORY_SAMPLE_SECONDS
from workers.wire.loras import read_entry, read_registry, register, unregister, withdraw

bp = Blueprint("admin", __name__, url_prefix="/admin")
bp.before_request(require_admin)

MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
REGISTRIES = {
    "started": StartedJobRegistry,
    "finished": FinishedJobRegistry,
    "failed": FailedJobRegistry,
    "deferred": DeferredJobRegistry,
    "scheduled": ScheduledJobRegistry,
    "canceled": CanceledJobRegistry,
}


@bp.get("/workers")
def workers() -> Response:
    conn = redis_conn()
    data = [
        WorkerObject(**{**asdict(w), "loop": w.loop or None}, alive=w.is_alive())
        for w in store.all_workers(conn)
    ]
    broker = BrokerState(**replication_state(conn).to_dict())
    return jsonify(WorkerList(object="list", data=data, broker=broker).dump())


@bp.get("/jobs")
def jobs_in_flight() -> Response:
    """The jobs live workers are running now (the dashboard's list): id, model, worker,
    tokens streamed so far, and when it was created and started. Never its prompt."""
    conn = redis_conn()
    running = [(w.name, job_id) for w in store.live_workers(conn) for job_id in w.current_jobs]
    data = []
    for worker, job_id in running:
        record = store.get_record(conn, job_id)
        if record is None:  # ended and expired since the worker's last heartbeat
            continue
        data.append(
            RunningJob(
                id=record.id,
                model=record.model,
                kind=record.kind,
                priority=record.priority,
                status=record.status,
                worker=worker,
                completion_tokens=record.completion_tokens,
                created_at=record.created_at,
                started_at=record.started_at,
            )
        )
    data.sort(key=lambda job: job.created_at)
    return jsonify(RunningJobList(object="list", data=data).dump())


@bp.get("/history")
def history() -> Response:
    """The last minutes of throughput, queue depth, running jobs and TTFT, for the
    dashboard's charts: samples the workers keep in Redis, so a reload keeps them."""
    data = [HistoryPoint(**point) for point in points(read_samples(redis_conn()))]
    body = History(object="list", interval_seconds=HISTORY_SAMPLE_SECONDS, data=data)
    return jsonify(body.dump())


@bp.get("/models")
def models() -> Response:
    """Per model: its published info and its pool state on each live worker."""
    conn = redis_conn()
    known = store.known_models(conn)
    live = store.live_workers(conn)
    ids = sorted(set(known) | store.served_models(live) | {m for w in live for m in w.pool})
    data = []
    for model in ids:
        pools = {w.name: w.pool[model] for w in live if model in w.pool}
        serving = [w.name for w in live if model in w.models]
        data.append(ModelPool(id=model, info=known.get(model, {}), serving=serving, pools=pools))
    return jsonify(ModelPoolList(object="list", data=data).dump())


def _command(op: str) -> Response:
    body = json_object({"model"})
    model = body.get("model")
    if not isinstance(model, str) or not MODEL_ID.match(model):
        raise InvalidRequest(
            "model must be a model id from the registry (letters, digits, '.', '_', '-'), "
            f"not a path or URL; got {str(model)[:80]!r}.",
            param="model",
        )
    conn = redis_conn()
    live = store.live_workers(conn)
    if model not in store.known_models(conn) and model not in store.served_models(live):
        raise ModelNotFound(model)
    targets = [w.name for w in live if op == COMMAND_LOAD or model in w.pool or model in w.models]
    if not targets:
        raise ServiceUnavailable("No live worker to send the command to.", code="no_worker")
    pipe = conn.pipeline()
    for name in targets:
        push_command(pipe, name, op, model)
    pipe.execute()
    response = jsonify(ModelCommandSent(op=op, model=model, workers=targets).dump())
    response.status_code = 202
    return response


@bp.post("/models/load")
def load_model() -> Response:
    return _command(COMMAND_LOAD)


@bp.post("/models/unload")
def unload_model() -> Response:
    return _command(COMMAND_UNLOAD)


@bp.get("/queues")
def queues() -> Response:
    conn = redis_conn()
    data = [
        QueueObject(
            name=queue.name,
            priority=keys.queue_priority(queue.name),
            queued=queue.count,
            **{
                name: registry(queue=queue).get_job_count(cleanup=False)
                for name, registry in REGISTRIES.items()
            },
        )
        for queue in sorted(store.all_queues(conn), key=lambda q: q.name)
    ]
    return jsonify(QueueList(object="list", data=data).dump())


@bp.get("/loras")
def list_loras() -> Response:
    """Every adapter: registered here or with its model in a registry TOML, and its state
    on each live worker holding its base model (ready, failed with why, or pending)."""
    conn = redis_conn()
    registered = read_registry(conn)
    live = store.live_workers(conn)
    data = []
    for name, base in sorted(loras.adapters_of(conn).items()):
        entry = registered.get(name, {"name": name, "base_model": base, "source": "registry"})
        states = adapter_states(live, entry)
        data.append(Lora(**entry, object="lora", state=states.state, workers=states.workers))
    return jsonify(LoraList(object="list", data=data).dump())


@bp.post("/loras")
def add_lora() -> Response:
    """Register an adapter `{"name", "path", "base_model"}` (a path inside LLMQ_ADAPTER_DIR,
    relative to it or absolute; stored relative) and answer once it is usable: 201 when a
    live worker has loaded it, 202 while none has yet (no worker holds the base model
    loaded, or the wait ran out), 400 when every worker holding the base model failed to
    load it (then it is not registered) or when it does not fit the base model as far as
    this machine can tell from the two files' headers (`api.lora_rollout`)."""
    body = json_object({"name", "path", "base_model"})
    name, path, base = body.get("name"), body.get("path"), body.get("base_model")
    for field, value in (("name", name), ("base_model", base)):
        if not isinstance(value, str) or not MODEL_ID.match(value):
            raise InvalidRequest(
                f"{field} must be an id (letters, digits, '.', '_', '-'), got {str(value)[:80]!r}.",
                param=field,
            )
    conn = redis_conn()
    known = store.known_models(conn)
    if name in known:
        raise InvalidRequest(f"{name!r} is a model id; choose another name.", param="name")
    if base not in known and base not in store.served_models(store.live_workers(conn)):
        raise ModelNotFound(base)
    try:
        path = _check_adapter(path, base)
    except LLMQRuntimeError as exc:
        raise InvalidRequest(str(exc), param="path") from None
    previous = read_entry(conn, name)
    entry = register(conn, name, path, base)
    rollout = AdapterRollout(conn, entry, current_app.config["LORA_WAIT_SECONDS"])
    rollout.announce()
    states = rollout.wait()
    if states.state == FAILED:
        if withdraw(conn, entry, previous):
            rollout.announce()  # the workers go back to what was registered before
        raise InvalidRequest(
            f"The adapter could not be loaded, so it was not registered: {states.errors()}",
            param="path",
        )
    lora = Lora(**entry, object="lora", state=states.state, workers=states.workers)
    response = jsonify(lora.dump())
    response.status_code = 201 if states.state == READY else 202
    return response


def _check_adapter(path: Any, base_model: str) -> str:
    """The adapter's path as the registry keeps it: relative to LLMQ_ADAPTER_DIR, where
    each worker resolves it in its own folder; `LLMQRuntimeError` if it does not fit."""
    adapter = adapter_file(path)
    try:
        base = GGUFFile(resolve_model(base_model).path())
    except LLMQRuntimeError:
        base = None  # the base model's file is not on this machine: its workers check it
    if base is not None:
        check_adapter(adapter, base)
    return adapter_path_in_dir(path)


@bp.delete("/loras/<name>")
def delete_lora(name: str) -> Response:
    """Unregister an adapter; the workers serving its base model unload it now (running
    sequences finish with it)."""
    conn = redis_conn()
    entry = read_entry(conn, name)
    if not unregister(conn, name):
        raise NotFound(f"The LoRA adapter {name!r} is not registered.", param="name")
    if entry is not None:
        AdapterRollout(conn, entry, 0).announce()
    return jsonify(LoraDeleted(name=name, object="lora", deleted=True).dump())


# ---------------------------------------------------------------- webhooks
# Endpoints and their delivery logs live in Redis (`workers.wire.webhooks`); deliveries are
# RQ jobs run by `llmq webhooks` (workers/webhooks/).


def _endpoint_body(endpoint: webhooks.Endpoint) -> dict[str, Any]:
    return wb.WebhookEndpoint(object="webhook_endpoint", **endpoint.public()).dump()


@bp.post("/webhooks")
def create_webhook() -> Response:
    body = json_object({"url", "events"})
    for param, problem in (
        ("url", webhooks.url_problem(body.get("url"))),
        ("events", webhooks.events_problem(body.get("events"))),
    ):
        if problem:
            raise InvalidRequest(problem, param=param)
    endpoint = webhooks.create_endpoint(redis_conn(), body["url"], body["events"])
    created = wb.WebhookEndpointCreated(
        object="webhook_endpoint", **endpoint.public(), secret=endpoint.secret
    )
    response = jsonify(created.dump())
    response.status_code = 201
    return response


@bp.get("/webhooks")
def list_webhooks() -> Response:
    data = [_endpoint_body(e) for e in webhooks.all_endpoints(redis_conn())]
    return jsonify({"object": "list", "data": data})


@bp.delete("/webhooks/<endpoint_id>")
def delete_webhook(endpoint_id: str) -> Response:
    if not webhooks.delete_endpoint(redis_conn(), endpoint_id):
        raise NotFound(f"No webhook endpoint with id {endpoint_id!r}.", param="id")
    body = wb.WebhookEndpointDeleted(id=endpoint_id, object="webhook_endpoint", deleted=True)
    return jsonify(body.dump())


@bp.get("/webhooks/<endpoint_id>/deliveries")
def webhook_deliveries(endpoint_id: str) -> Response:
    conn = redis_conn()
    if webhooks.get_endpoint(conn, endpoint_id) is None:
        raise NotFound(f"No webhook endpoint with id {endpoint_id!r}.", param="id")
    data = [wb.WebhookDelivery(**d).dump() for d in webhooks.read_deliveries(conn, endpoint_id)]
    return jsonify({"object": "list", "data": data})


@bp.get("/webhooks/dead")
def dead_webhooks() -> Response:
    data = []
    for job in webhook_jobs.dead_deliveries(redis_conn()):
        endpoint_id, event = (list(job.args) + [None, {}])[:2]
        event = event if isinstance(event, dict) else {}
        failed_at = job.ended_at.timestamp() if job.ended_at else None
        latest = job.latest_result()
        error = (
            latest.exc_string.strip().splitlines()[-1][:300]
            if latest and latest.exc_string
            else None
        )
        data.append(
            wb.DeadDelivery(
                delivery=job.id,
                endpoint_id=str(endpoint_id),
                event_id=str(event.get("id", "")),
                type=str(event.get("type", "")),
                error=error,
                failed_at=failed_at,
            ).dump()
        )
    return jsonify({"object": "list", "data": data})


@bp.post("/webhooks/dead/<delivery>/redeliver")
def redeliver_webhook(delivery: str) -> Response:
    if not keys.is_valid_job_id(delivery) or not webhook_jobs.redeliver(redis_conn(), delivery):
        raise NotFound(f"No dead webhook delivery with id {delivery!r}.", param="delivery")
    body = wb.Redelivered(delivery=delivery, object="webhook_delivery", status="queued")
    response = jsonify(body.dump())
    response.status_code = 202
    return response
