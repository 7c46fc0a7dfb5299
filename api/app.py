"""The Flask application factory: `gunicorn -c api/gunicorn_conf.py 'api.app:create_app()'`.

One blueprint per surface (`openai`, `jobs`, `files`, `batches`, `ops`, `admin`, `ui`), one
Redis client (a bounded pool) shared by every request in `app.extensions["redis"]`, one
reader of job streams for every waiting client in `app.extensions["streams"]`, one error
handler family (api.errors). This process never imports the engine: models live in worker processes.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Mapping
from typing import Any

from flask import Flask, Response, current_app, g, request

from api import admin, jobs, openai_api, openapi, ops, rate_limits, ui
from api.batches import files
from api.batches import routes as batches
from api.config import broker_settings, from_env, make_events, make_redis, redis_conn
from api.directory import DirectoryCache
from api.errors import register_error_handlers
from api.model_texts import ModelTexts
from api.request_counts import RequestCounts
from api.responses import routes as responses_api
from api.streams.slot_routing import BucketReaders
from api.streams.stream_hub import MAX_READERS, StreamHub
from workers.wire.broker import Replication

log = logging.getLogger(__name__)

REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def create_app(test_config: Mapping[str, Any] | None = None) -> Flask:
    """Build the app; `test_config` overrides settings (and may pass `REDIS_CLIENT`)."""
    app = Flask(__name__)
    app.config.from_mapping(from_env())
    if test_config:
        app.config.update(test_config)
    app.json.sort_keys = False  # keep OpenAI's field order in bodies
    broker = broker_settings(app.config)
    client = app.config.get("REDIS_CLIENT") or make_redis(broker, app.config["REDIS_CONNECTIONS"])
    app.extensions["redis"] = client
    # the readers of every waiting client's job stream, on connections of their own (each
    # holds one while it blocks): LLMQ_API_REDIS_CONNECTIONS stays the requests' bound
    streams = app.config.get("REDIS_CLIENT") or make_redis(broker, MAX_READERS + 4)
    # where the job streams are is chosen here, once: on one Redis (`SharedReaders`, the
    # default), or on the events cluster, a reader per event bucket (`BucketReaders`)
    placement = None
    settings = app.config.get("EVENTS")
    if settings is not None and settings.clustered:
        events = app.config.get("EVENTS_CLIENT") or make_events(settings, streams)
        app.extensions["events"] = events
        placement = BucketReaders(events)
    app.extensions["streams"] = StreamHub(streams, placement=placement)
    # with Sentinels, a 202 waits for the job to reach the replicas (`wire.broker`)
    app.extensions["replication"] = app.config.get("REPLICATION") or Replication.of(broker)
    app.extensions["model_texts"] = ModelTexts()  # requests checked with tokenizer + template
    app.extensions["directory"] = DirectoryCache()  # published and served models, <= 1 s old
    app.extensions["request_counts"] = RequestCounts()  # to Redis once a second

    register_error_handlers(app)
    for blueprint in (
        openai_api.bp,
        jobs.bp,
        files.bp,
        batches.bp,
        ops.bp,
        admin.bp,
        openapi.bp,
        ui.bp,
        responses_api.bp,  # OpenAI's Responses API on the job system
    ):
        app.register_blueprint(blueprint)
    app.before_request(_assign_request_id)
    app.after_request(_finish_request)
    rate_limits.install(app)  # LLMQ_RATE_LIMIT_RPM / _TPM: OpenAI's headers on /v1 answers
    return app


def _assign_request_id() -> None:
    # A client's X-Request-Id is echoed only if it is safe to put in logs (no CR/LF forging).
    given = request.headers.get("X-Request-Id", "")
    g.request_id = given if REQUEST_ID.match(given) else uuid.uuid4().hex


def _finish_request(response: Response) -> Response:
    response.headers["X-Request-Id"] = g.get("request_id", "")
    if not g.get("broker_down"):  # counting would only wait on the dead broker again
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        counts = current_app.extensions["request_counts"]
        counts.add(redis_conn(), request.method, rule, response.status_code)
    return response
