"""The `openai` blueprint: /v1/models and the three OpenAI-compatible POST endpoints."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from api import store
from api.auth import require_api_key
from api.body import json_object
from api.config import redis_conn
from api.flow import respond
from api.schemas import parse_request
from workers.wire.job import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS

bp = Blueprint("openai", __name__, url_prefix="/v1")
bp.before_request(require_api_key)


@bp.get("/models")
def list_models() -> Response:
    """Models published by workers plus any a live worker serves, in OpenAI's list shape."""
    conn = redis_conn()
    known = store.known_models(conn)
    live = store.live_workers(conn)
    served = store.served_models(live)
    data = []
    for model in sorted(set(known) | served):
        info = known.get(model, {})
        entry = {
            "id": model,
            "object": "model",
            "created": int(info.get("created", 0)) if isinstance(info.get("created"), int) else 0,
            "owned_by": "llmq",
            "ready": model in served,
        }
        if isinstance(info.get("context_length"), int):
            entry["max_model_len"] = info["context_length"]
        if isinstance(info.get("chat_template"), bool):  # chat requests can be rendered
            entry["chat_template"] = info["chat_template"]
        data.append(entry)
    return jsonify({"object": "list", "data": data})


@bp.post("/completions")
def completions() -> Response:
    return respond(COMPLETIONS, parse_request(COMPLETIONS, json_object()))


@bp.post("/chat/completions")
def chat_completions() -> Response:
    return respond(CHAT_COMPLETIONS, parse_request(CHAT_COMPLETIONS, json_object()))


@bp.post("/embeddings")
def embeddings() -> Response:
    return respond(EMBEDDINGS, parse_request(EMBEDDINGS, json_object()))
