"""The `openai` blueprint: /v1/models and the three OpenAI-compatible POST endpoints."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify

from api import loras, store
from api.auth import require_api_key
from api.body import json_object
from api.config import redis_conn
from api.errors import ModelNotFound
from api.flow import respond
from api.schemas import parse_request
from workers.wire.job import CHAT_COMPLETIONS, COMPLETIONS, EMBEDDINGS

bp = Blueprint("openai", __name__, url_prefix="/v1")
bp.before_request(require_api_key)


@bp.get("/models")
def list_models() -> Response:
    """Models published by workers plus any a live worker serves, in OpenAI's list shape,
    then the LoRA adapters (vLLM's way: `parent` names the base model)."""
    known, served = _models()
    data = [_model_object(m, known.get(m, {}), served) for m in sorted(set(known) | served)]
    adapters = loras.adapters_of(redis_conn())
    data += [_adapter_object(name, base, served) for name, base in sorted(adapters.items())]
    return jsonify({"object": "list", "data": data})


@bp.get("/models/<path:model_id>")
def retrieve_model(model_id: str) -> Response:
    """One model (the `openai` client's `models.retrieve`); 404 if nobody knows it."""
    known, served = _models()
    if model_id not in known and model_id not in served:
        base = loras.adapters_of(redis_conn()).get(model_id)
        if base is None:
            raise ModelNotFound(model_id)
        return jsonify(_adapter_object(model_id, base, served))
    return jsonify(_model_object(model_id, known.get(model_id, {}), served))


def _models() -> tuple[dict[str, dict[str, Any]], set[str]]:
    conn = redis_conn()
    return store.known_models(conn), store.served_models(store.live_workers(conn))


def _model_object(model: str, info: dict[str, Any], served: set[str]) -> dict[str, Any]:
    created = info.get("created")
    entry = {
        "id": model,
        "object": "model",
        "created": created if isinstance(created, int) else 0,
        "owned_by": "llmq",
        "ready": model in served,
    }
    if isinstance(info.get("context_length"), int):
        entry["max_model_len"] = info["context_length"]
    if isinstance(info.get("chat_template"), bool):  # chat requests can be rendered
        entry["chat_template"] = info["chat_template"]
    return entry


def _adapter_object(name: str, base: str, served: set[str]) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "llmq",
        "parent": base,
        "ready": base in served,
    }


@bp.post("/completions")
def completions() -> Response:
    return respond(COMPLETIONS, parse_request(COMPLETIONS, json_object()))


@bp.post("/chat/completions")
def chat_completions() -> Response:
    return respond(CHAT_COMPLETIONS, parse_request(CHAT_COMPLETIONS, json_object()))


@bp.post("/embeddings")
def embeddings() -> Response:
    return respond(EMBEDDINGS, parse_request(EMBEDDINGS, json_object()))
