"""The `ops` blueprint: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify
from prometheus_client import CONTENT_TYPE_LATEST

from api import metrics, store
from api.config import redis_conn
from api.errors import ServiceUnavailable

bp = Blueprint("ops", __name__)


@bp.get("/health")
def health() -> Response:
    """The process answers; says nothing about Redis or workers (that is /ready)."""
    return jsonify({"status": "ok"})


@bp.get("/ready")
def ready() -> Response:
    """Redis answers and at least one live worker serves at least one model."""
    conn = redis_conn()
    conn.ping()
    workers = [w for w in store.live_workers(conn) if w.models]
    if not workers:
        raise ServiceUnavailable("No live worker serves a model yet.", code="no_worker")
    models = sorted(store.served_models(workers))
    return jsonify({"status": "ready", "workers": len(workers), "models": models})


@bp.get("/metrics")
def prometheus() -> Response:
    return Response(metrics.render(redis_conn()), mimetype=CONTENT_TYPE_LATEST)
