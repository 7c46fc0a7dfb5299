"""Weights the torch backend prepared, kept on disk so that the next load maps them.

Dequantizing GGUF blocks, packing 4-bit layouts and requantizing the LM head took most of a
load (bench/log/2026-11-23-kernel-layer-avx2-epyc.md "Load and memory"). What they produce
depends only on the file's bytes, the kernels the backend chose, torch's version and the
CPU, so it is saved once per such key
under `LLMQ_CACHE_DIR/weights/` and read back with `torch.load(mmap=True)`: a later load, or a
second worker process, maps the same file pages instead of building its own copy
(copy-on-write, so nothing written to a tensor reaches the file). The tensors are the very
ones the build made, so a model loads bitwise the same either way
(tests/runtime/test_prepared.py). `LLMQ_WEIGHT_CACHE=0` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from runtime.cache_dir import cache_dir, known_digest, source_digest, write_atomically
from runtime.gguf_file import CONTENT_DIGEST, GGUFFile
from runtime.kernels.base import TensorPart
from runtime.kernels.cpu_features import cpu_features

log = logging.getLogger(__name__)

# the code that builds weights and lays out the saved file: a change to any of these files
# makes new keys, so a cache never outlives the code that wrote it
RUNTIME = Path(__file__).resolve().parent.parent
BUILDERS = tuple(
    RUNTIME / name
    for name in ("kernels/torch_backend.py", "kernels/gguf_blocks.py", "kernels/prepared.py")
    + ("kernels/base.py", "kernels/native.py", "gguf_file.py")
    + ("kernels/repack.c", "kernels/repack.py")
)
DISABLE_ENV = "LLMQ_WEIGHT_CACHE"  # "0": build every weight from the file at every load
# what the folder may hold: beyond it the least recently loaded files go (each model file
# and plan has its own: SmolLM2 95 MB, Gemma 3 500 MB)
MAX_FOLDER_BYTES = 4 << 30
# a store this large is written after the load returns (`PreparedWeights.save`): writing a
# Llama 3.2 1B Q4_K_M file's 1 GiB took 0.4 s user and 2.3 s system CPU time on the 2-core
# EPYC (bench/log/2026-11-28-cold-load-avx512-epyc.md), more than building it
BACKGROUND_SAVE_BYTES = 256 << 20


@dataclass(frozen=True)
class SavedWeight:
    """What rebuilds one weight: its class's kind, its shape and its tensors."""

    kind: str
    shape: tuple[int, int]
    tensors: dict[str, torch.Tensor]


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1") not in ("0", "false", "no", "off")


def weight_key(parts: list[TensorPart], input_scale: np.ndarray | None) -> str:
    """Names what a fused weight is built from: its tensors with their row operations, and
    the input scale folded into it."""
    pieces = []
    for part in parts:
        piece = part.name
        if part.row_order is not None:
            piece += "@" + _array_digest(part.row_order)
        if part.scale != 1.0:
            piece += f"*{float(part.scale)!r}"
        pieces.append(piece)
    key = "linear:" + "+".join(pieces)
    if input_scale is not None:
        key += "|in:" + _array_digest(input_scale)
    return key


class PreparedWeights:
    """The saved weights of one model file on one plan: what was found on disk, and what
    this load built and adds to it."""

    def __init__(self, path: Path | Callable[[], Path], found: dict[str, SavedWeight]) -> None:
        self._path = path  # or what finds it when saving: a file never hashed here
        self.found = found
        self.built: dict[str, SavedWeight] = {}
        self.saving: threading.Thread | None = None  # a save still writing (`save`)

    @property
    def path(self) -> Path:
        if callable(self._path):
            self._path = self._path()
        return self._path

    @classmethod
    def for_file(cls, f: GGUFFile, kernels: dict[str, str]) -> PreparedWeights | None:
        """The store for `f` under the backend's `kernels` (its `describe()`), with whatever
        an earlier load saved; None when the cache is off or the file cannot be read. A file
        this machine never hashed (runtime/cache_dir.py `known_digest`) has no store under
        its path, so it is hashed when its weights are saved, not before they are built
        (0.58 s CPU of a Llama 3.2 1B Q4_K_M's 2.9 s cold load): a copy of a file hashed
        under another path builds its own once."""
        if not enabled():
            return None
        own_key = type(f).content_key is not GGUFFile.content_key  # a view that keys itself
        if not own_key and known_digest(f.path, CONTENT_DIGEST) is None:
            return cls(functools.partial(_store_path, f, kernels), {})
        try:
            path = _store_path(f, kernels)
        except OSError as exc:
            log.warning("prepared weights off for %s (%s)", f.path.name, exc)
            return None
        return None if path is None else cls(path, _read(path))

    def get(self, key: str) -> SavedWeight | None:
        return self.found.get(key)

    def add(self, key: str, saved: SavedWeight) -> None:
        self.built[key] = saved

    def save(self) -> None:
        """Writes found and built weights together when this load built any; a write that
        fails costs the next load its speed, never this one its model. Over
        BACKGROUND_SAVE_BYTES the write runs in a thread (`saving`) while the model serves:
        the interpreter waits for it before it exits, and a worker that loads the file
        meanwhile builds its own and writes the same file."""
        if not self.built:
            return
        every = {**self.found, **self.built}
        payload = {
            key: {"kind": w.kind, "shape": list(w.shape), "tensors": w.tensors}
            for key, w in every.items()
        }
        size = sum(t.nbytes for w in self.built.values() for t in w.tensors.values())
        if size < BACKGROUND_SAVE_BYTES:
            self._write(payload)
            return
        self.saving = threading.Thread(
            target=self._write, args=(payload,), name="llmq-prepared-save"
        )
        self.saving.start()

    def _write(self, payload: dict) -> None:
        try:
            if self.path is None:  # the file's view keeps nothing
                return
            write_atomically(self.path, lambda target: torch.save(payload, target))
            _keep_within(self.path.parent, MAX_FOLDER_BYTES, self.path)
        except OSError as exc:
            log.warning("could not save prepared weights to %s (%s)", self.path, exc)


def _store_path(f: GGUFFile, kernels: dict[str, str]) -> Path | None:
    """Where the store of `f` under `kernels` is kept (None: `f` keeps nothing)."""
    content = f.content_key()
    if content is None:
        return None
    return cache_dir() / "weights" / f"{f.path.stem}-{_store_key(content, kernels)}.pt"


def _store_key(digest: str, kernels: dict[str, str]) -> str:
    """Everything the prepared tensors depend on besides the file: the backend's weight
    kinds and kernels (neither threads nor the KV cache change a weight), torch's version
    and the CPU's vector level."""
    described = {k: v for k, v in kernels.items() if k not in ("threads", "kv cache")}
    code = source_digest(*BUILDERS)
    what = json.dumps([digest, described, torch.__version__, cpu_features().level, code])
    return hashlib.sha256(what.encode()).hexdigest()[:20]


def _read(path: Path) -> dict[str, SavedWeight]:
    """The weights saved at `path`; none when it is missing or unreadable (a damaged file
    is removed and rebuilt by this load)."""
    if not path.exists():
        return {}
    with contextlib.suppress(OSError):  # a read-only cache is still read
        os.utime(path)  # recently loaded: the last to go (`_keep_within`)
    try:
        payload = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
        return {
            key: SavedWeight(w["kind"], (int(w["shape"][0]), int(w["shape"][1])), w["tensors"])
            for key, w in payload.items()
        }
    except Exception as exc:  # noqa: BLE001 - any damage means: build again
        log.warning("prepared weights at %s unreadable, rebuilding (%s)", path, exc)
        with contextlib.suppress(OSError):  # another load's save replaces it anyway
            path.unlink()
        return {}


def _keep_within(folder: Path, max_bytes: int, keep: Path) -> None:
    """Removes the least recently loaded files of `folder` until it holds `max_bytes`."""
    files = sorted(folder.glob("*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
    total = 0
    for path in files:
        total += path.stat().st_size
        if total > max_bytes and path != keep:
            path.unlink(missing_ok=True)


def _array_digest(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a)
    return hashlib.sha256(a.dtype.str.encode() + a.tobytes()).hexdigest()[:16]
