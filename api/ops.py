"""The `ops` blueprint: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from flask import Blueprint, Response, current_app, jsonify
from prometheus_client import CONTENT_TYPE_LATEST

from api import metrics, store
from api.bodies import BrokerState, Health, Ready
from api.config import redis_conn, stream_hub
from api.errors import ServiceUnavailable
from workers.wire.broker import replication_state
from workers.wire.worker_info import LOADING, READY, WorkerInfo

bp = Blueprint("ops", __name__)


@bp.get("/health")
def health() -> Response:
    """The process answers; says nothing about Redis or workers (that is /ready)."""
    return jsonify(Health(status="ok").dump())


@bp.get("/ready")
def ready() -> Response:
    """Redis answers and a live worker has a model loaded (pool state `ready`): a request
    for it starts at once. A worker still loading its models is not ready: a load takes
    seconds, and a load balancer (or `llmq serve`) must not send the first request into it.
    """
    conn = redis_conn()
    conn.ping()
    workers = [w for w in store.live_workers(conn) if w.models]
    if not workers:
        raise ServiceUnavailable("No live worker serves a model yet.", code="no_worker")
    ready_on = [_in_state(w, READY) for w in workers]
    models = sorted({m for ready_models in ready_on for m in ready_models})
    if not models:
        loading = sorted({m for w in workers for m in _in_state(w, LOADING)})
        detail = f" (loading: {', '.join(loading)})" if loading else ""
        raise ServiceUnavailable(
            f"No worker has a model loaded yet{detail}; retry later.", code="model_loading"
        )
    workers_ready = sum(1 for ready_models in ready_on if ready_models)
    broker = BrokerState(**replication_state(conn).to_dict())
    return jsonify(
        Ready(status="ready", workers=workers_ready, models=models, broker=broker).dump()
    )


def _in_state(worker: WorkerInfo, state: str) -> list[str]:
    """The models in `worker`'s pool (as it published it) in `state`."""
    return [
        m
        for m, entry in worker.pool.items()
        if isinstance(entry, dict) and entry.get("state") == state
    ]


@bp.get("/metrics")
def prometheus() -> Response:
    current_app.extensions["request_counts"].flush(redis_conn())  # this process's, up to now
    return Response(metrics.render(redis_conn(), stream_hub()), mimetype=CONTENT_TYPE_LATEST)
