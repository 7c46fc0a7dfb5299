"""LoRA adapters as the API sees them: which exist for a model (registered through
`/admin/loras` in `keys.LORAS`, or named with their model in a worker's registry TOML and
published in `keys.MODELS`), a `model` that names an adapter (vLLM's convention), and the
checks that make an unknown adapter a 404 at submission."""

from __future__ import annotations

from typing import Any

import redis

from api import store
from api.errors import AdapterNotFound
from workers.wire.loras import read_registry


def adapters_of(conn: redis.Redis, models: dict[str, Any] | None = None) -> dict[str, str]:
    """Every known adapter name -> its base model (`models`: `store.known_models`, read
    here when not given)."""
    models = store.known_models(conn) if models is None else models
    bases = {
        name: model
        for model, info in models.items()
        for name in info.get("loras", []) or []
        if isinstance(name, str)
    }
    for name, entry in read_registry(conn).items():
        if isinstance(entry.get("base_model"), str):
            bases[name] = entry["base_model"]
    return bases


def resolve(conn: redis.Redis, req: Any, models: dict[str, Any]) -> None:
    """Check the adapters of a generation request against what Redis knows (`apply`);
    `models` as `store.known_models` gives them."""
    if getattr(req, "lora", None) or req.model not in models:
        apply(req, models, adapters_of(conn, models))


def apply(req: Any, models: dict[str, Any], adapters: dict[str, str]) -> None:
    """A `model` naming an adapter (and no model) becomes its base model with that adapter
    first in `lora` (scale 1); every adapter in `lora` must exist for the model, else 404.
    `adapters` maps adapter names to their base models (`adapters_of`)."""
    if not hasattr(req, "lora"):
        return  # embeddings take no adapters
    lora = req.lora
    if req.model not in models and req.model in adapters:
        lora = [{"name": req.model, "scale": 1.0}, *(lora or [])]
        req.model, req.lora = adapters[req.model], lora
    for entry in lora or []:
        if adapters.get(entry["name"]) != req.model:
            raise AdapterNotFound(entry["name"], req.model)
