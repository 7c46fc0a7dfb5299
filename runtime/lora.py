"""LoRA adapters in llama.cpp's GGUF layout, applied per row of a batched step.

An adapter file holds `general.type = adapter`, `adapter.type = lora`, `adapter.lora.alpha`
and, for each adapted base tensor `<name>` (`[out, in]`), `<name>.lora_a` `[rank, in]` and
`<name>.lora_b` `[out, rank]` (numpy order; GGUF's `ne` reversed). The change to the weight
is `scale * B @ A` with llama.cpp's scale: user scale x alpha / rank (alpha 0: user scale).

The base weights are never touched. At load, each adapted tensor is mapped onto the model's
weight exactly as the model built it (`LinearSources` records that): B's rows go where the
tensor's rows went in a fused weight (q/k/v, gate/up), reordered and scaled as they were
(llama's q/k un-interleave, the attention scale in q), and A's columns take the input scale
folded into the weight (an RMSNorm weight). One weight's pieces become one pair `(A, B)`,
B block-structured, so one adapter costs two small products per weight.

In a step, `RowAdapters` knows which rows use which adapters at what scale; `apply` adds
`(x[rows] @ A.T * scale) @ B.T` to those rows of the base product, which runs once for all.
On the host (and the CPU's tensor path) each row's delta is summed in one fixed order
whatever shares its batch (runtime/kernels/dense_rows.c; numpy's BLAS and torch's CPU GEMM
round a row by how many rows they are given), and a row's adapters are added in key order,
so a request's logits do not depend on its batch (CONTRACT "Same request, same answer").

Where the engine keeps adapter slots on its device (the tensor path with decode graphs,
runtime/lora_slots.py), LoRA rows go through those instead, in decode steps replayed from a
graph and in eager steps alike, so that a row's logits do not depend on which its step
took; `RowAdapters` remains the host path's and the fallback for a step the slots cannot
hold.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime.errors import AdapterError, ModelFormatError
from runtime.gguf_file import GGUFFile
from runtime.kernels import Backend, Embedding, TensorPart, Weight
from runtime.kernels.native import dense_rows

LORA_A, LORA_B = ".lora_a", ".lora_b"
UNSUPPORTED_TENSORS = ("token_embd.weight", "output.weight")
ADAPTER_DIR_ENV = "LLMQ_ADAPTER_DIR"  # the only folder adapters are loaded from by name
# the device's adapter slots (runtime/lora_slots.py, EngineConfig.lora_slots / lora_rank):
# adapters one static decode step can use, and the largest rank (per weight) a slot takes
DEFAULT_LORA_SLOTS = 8
DEFAULT_LORA_RANK = 64


def adapter_file(path: str, adapter_dir: str | Path | None = None) -> Path:
    """The adapter file `path` names inside the adapter folder (`LLMQ_ADAPTER_DIR`),
    resolved: relative to the folder or absolute, as long as the file it leads to (after
    '..' and symlinks) lies inside the folder; `AdapterError` for a URL, a path that leads
    out, or one that names no file."""
    folder = adapter_dir or os.environ.get(ADAPTER_DIR_ENV)
    if not folder:
        raise AdapterError(f"LoRA adapters can only be loaded when {ADAPTER_DIR_ENV} is set")
    if not isinstance(path, str) or not path or "://" in path or "\0" in path:
        raise AdapterError(
            f"an adapter path must be a file path inside {ADAPTER_DIR_ENV}, got {str(path)[:80]!r}"
        )
    root = Path(folder).resolve()
    target = (root / path).resolve()  # an absolute `path` replaces the root here
    if not target.is_relative_to(root):
        raise AdapterError(
            f"adapter path {path[:80]!r} leads out of {ADAPTER_DIR_ENV} ({root}); "
            "symlinks are followed"
        )
    if not target.is_file():
        raise AdapterError(f"no adapter file {path[:80]!r} in {ADAPTER_DIR_ENV} ({root})")
    return target


def adapter_path_in_dir(path: str, adapter_dir: str | Path | None = None) -> str:
    """`path` as the registry stores it: relative to the adapter folder, resolved
    (`adapter_file` checks it), so a worker whose folder is mounted elsewhere finds it."""
    folder = adapter_dir or os.environ.get(ADAPTER_DIR_ENV) or ""
    return adapter_file(path, adapter_dir).relative_to(Path(folder).resolve()).as_posix()


@dataclass(frozen=True)
class LinearSource:
    """Where one GGUF tensor `[out, in]` went: rows `row_start ..` of `weight`, as `part`."""

    weight: Weight
    row_start: int
    part: TensorPart
    input_scale: np.ndarray | None
    shape: tuple[int, int]


class LinearSources:
    """A backend that records, for every tensor a model builds a linear weight from, where
    it went; passed to a model's constructor in place of the real backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.name = backend.name
        self.device = getattr(backend, "device", None)  # the tensor backend's device
        self.kv_dtype = getattr(backend, "kv_dtype", None)  # the host path's KV pool type
        self.sources: dict[str, LinearSource] = {}

    def linear(
        self, f: GGUFFile, parts: list[TensorPart], input_scale: np.ndarray | None = None
    ) -> Weight:
        weight = self.backend.linear(f, parts, input_scale)
        row = 0
        for part in parts:
            shape = f.blocks(part.name)[2]
            out_in = (int(shape[0]), int(shape[1]))
            self.sources[part.name] = LinearSource(weight, row, part, input_scale, out_in)
            row += out_in[0]
        return weight

    def embedding(self, f: GGUFFile, name: str) -> Embedding:
        return self.backend.embedding(f, name)

    def head(self, f: GGUFFile, name: str, tied: Embedding | None = None) -> Weight:
        return self.backend.head(f, name, tied)

    def describe(self) -> dict[str, str]:
        return self.backend.describe()

    def stored_bytes(self, f: GGUFFile, name: str, role: str) -> int:
        return self.backend.stored_bytes(f, name, role)


@dataclass
class LoraDelta:
    """One weight's low-rank change: `A` `[R, in]`, `B` `[out, R]` float32, laid out like the
    weight (R sums the ranks of the tensors fused into it; alpha / rank is in B)."""

    a: np.ndarray
    b: np.ndarray
    on_device: dict[Any, tuple[Any, Any]] = field(default_factory=dict)  # device -> (A, B)
    _bt: np.ndarray | None = None

    @property
    def bt(self) -> np.ndarray:
        """B transposed `[R, out]`, C-contiguous: dense_rows.c's form, made once."""
        if self._bt is None:
            self._bt = np.ascontiguousarray(self.b.T)
        return self._bt

    def tensors(self, device: Any) -> tuple[Any, Any]:
        """`(A, B)` as float32 tensors on `device`, uploaded once (the tensor forward pass)."""
        if device not in self.on_device:
            import torch

            self.on_device[device] = tuple(torch.from_numpy(m).to(device) for m in (self.a, self.b))
        return self.on_device[device]


class LoraAdapter:
    """An adapter bound to one loaded model: its deltas keyed by the model's weights."""

    def __init__(self, name: str, path: Path, deltas: dict[int, LoraDelta], alpha: float) -> None:
        self.name, self.path, self.alpha = name, path, alpha
        self.deltas = deltas  # id(weight) -> delta; the model keeps its weights alive
        self.key = f"{name}#{uuid.uuid4().hex[:12]}"  # a reload is a different adapter

    def __repr__(self) -> str:
        return f"LoraAdapter({self.name!r}, {len(self.deltas)} weights)"

    @property
    def nbytes(self) -> int:
        return sum(d.a.nbytes + d.b.nbytes for d in self.deltas.values())


def load_adapter(
    name: str, path: str | Path, sources: dict[str, LinearSource], architecture: str
) -> LoraAdapter:
    """Read the adapter at `path` and map it onto the weights `sources` describes (a model
    of `architecture`); `AdapterError` says what does not fit."""
    f = _open(path, architecture)
    alpha = float(f.metadata.get("adapter.lora.alpha", 0.0) or 0.0)
    pieces: dict[int, list[tuple[LinearSource, np.ndarray, np.ndarray]]] = {}
    for base in _adapted_tensors(f):
        source = _source(f, base, sources)
        _check_shapes(f, base, source.shape)
        a, b = f.tensor(base + LORA_A), f.tensor(base + LORA_B)  # [r, in], [out, r]
        rank = a.shape[0]
        b = b * np.float32(alpha / rank) if alpha else b
        pieces.setdefault(id(source.weight), []).append((source, a, b))
    deltas = {key: _fuse(group) for key, group in pieces.items()}
    return LoraAdapter(name, Path(path), deltas, alpha)


def check_adapter(path: str | Path, base: GGUFFile) -> None:
    """What `load_adapter` would refuse, from the two files' headers alone (no weights are
    read): for the API, so a wrong architecture or shape is refused before any worker."""
    f = _open(path, base.architecture)
    for name in _adapted_tensors(f):
        if name in UNSUPPORTED_TENSORS or not base.has_tensor(name):
            _source(f, name, {})  # raises the message the worker would give
        shape = base.blocks(name)[2]
        if len(shape) != 2:
            _source(f, name, {})
        _check_shapes(f, name, (int(shape[0]), int(shape[1])))


def _open(path: str | Path, architecture: str) -> GGUFFile:
    try:
        f = GGUFFile(path)
    except ModelFormatError as exc:
        raise AdapterError(str(exc)) from exc
    _check_metadata(f, architecture)
    return f


def _check_metadata(f: GGUFFile, architecture: str) -> None:
    kind, lora = f.metadata.get("general.type"), f.metadata.get("adapter.type")
    if kind != "adapter" or lora != "lora":
        raise AdapterError(
            f"{f.path.name}: not a LoRA adapter (general.type {kind!r}, adapter.type "
            f"{lora!r}; expected 'adapter' and 'lora')"
        )
    arch = f.metadata.get("general.architecture")
    if arch != architecture:
        raise AdapterError(
            f"{f.path.name}: adapter for architecture {arch!r}, but the model is {architecture!r}"
        )


def _adapted_tensors(f: GGUFFile) -> list[str]:
    names = f.tensor_names()
    bases = [n[: -len(LORA_A)] for n in names if n.endswith(LORA_A)]
    for n in names:
        if not n.endswith((LORA_A, LORA_B)):
            raise AdapterError(f"{f.path.name}: tensor {n!r} is not a .lora_a/.lora_b tensor")
        if n.endswith(LORA_B) and n[: -len(LORA_B)] + LORA_A not in names:
            raise AdapterError(f"{f.path.name}: {n!r} has no matching .lora_a tensor")
    for base in bases:
        if base + LORA_B not in names:
            raise AdapterError(f"{f.path.name}: {base + LORA_A!r} has no matching .lora_b tensor")
    if not bases:
        raise AdapterError(f"{f.path.name}: the adapter holds no .lora_a/.lora_b tensors")
    return bases


def _source(f: GGUFFile, base: str, sources: dict[str, LinearSource]) -> LinearSource:
    if base in UNSUPPORTED_TENSORS:
        raise AdapterError(
            f"{f.path.name}: adapters on {base} are not supported (embedding and output "
            "adapters); only attention and feed-forward weights can be adapted"
        )
    source = sources.get(base)
    if source is None:
        raise AdapterError(
            f"{f.path.name}: tensor {base!r} is not a linear weight of the base model "
            "(hint: maybe wrong base model?)"
        )
    return source


def _check_shapes(f: GGUFFile, base: str, weight: tuple[int, int]) -> None:
    a, b = f.blocks(base + LORA_A)[2], f.blocks(base + LORA_B)[2]
    out, inp = weight
    if len(a) != 2 or len(b) != 2 or a[1] != inp or b[0] != out:
        raise AdapterError(
            f"{f.path.name}: {base!r} has lora_a {list(a)} and lora_b {list(b)}, but the base "
            f"weight is [{out}, {inp}] (expected [rank, {inp}] and [{out}, rank]; "
            "hint: maybe wrong base model?)"
        )
    if a[0] != b[1] or a[0] < 1:
        raise AdapterError(
            f"{f.path.name}: {base!r} has lora_a rank {a[0]} but lora_b rank {b[1]} "
            "(lora_a must be [rank, in] and lora_b [out, rank])"
        )


def _fuse(group: list[tuple[LinearSource, np.ndarray, np.ndarray]]) -> LoraDelta:
    """One weight's pieces as one `(A, B)`: each piece's B in its rows of the fused weight,
    with the part's row order and scale, and A times the weight's input scale."""
    out = group[0][0].weight.shape[0]
    total_rank = sum(a.shape[0] for _, a, _ in group)
    a_all = np.zeros((total_rank, group[0][1].shape[1]), np.float32)  # [R, in]
    b_all = np.zeros((out, total_rank), np.float32)  # [out, R]
    col = 0
    for source, a, b in group:
        rank, part = a.shape[0], source.part
        if part.row_order is not None:
            b = b[part.row_order]
        rows = slice(source.row_start, source.row_start + source.shape[0])
        b_all[rows, col : col + rank] = b * np.float32(part.scale)
        a_all[col : col + rank] = a if source.input_scale is None else a * source.input_scale
        col += rank
    return LoraDelta(a_all, b_all)


AdapterStack = tuple[tuple[LoraAdapter, float], ...]


def normalize_stack(adapters: Sequence[tuple[LoraAdapter, float]]) -> AdapterStack:
    """The stack as the engine keeps it: one entry per adapter (scales of a repeated one
    add up), in a fixed order (the sum does not depend on it), finite scales."""
    scales: dict[str, tuple[LoraAdapter, float]] = {}
    for adapter, scale in adapters:
        if isinstance(scale, bool) or not isinstance(scale, int | float):
            raise AdapterError(f"a LoRA scale must be a number, got {scale!r}")
        if not math.isfinite(scale):
            raise AdapterError(f"a LoRA scale must be finite, got {scale!r}")
        previous = scales.get(adapter.key, (adapter, 0.0))[1]
        scales[adapter.key] = (adapter, previous + float(scale))
    return tuple(scales[key] for key in sorted(scales))


def stack_namespace(adapters: AdapterStack) -> str:
    """What the prefix cache adds to a model's namespace for this stack ('' for none):
    blocks computed under different adapters or scales are never shared."""
    return "".join(f"|lora:{a.key}@{scale!r}" for a, scale in adapters)


class RowAdapters:
    """Which rows of a step's packed tokens use which adapter, at what scale."""

    def __init__(self, groups: list[tuple[LoraAdapter, slice | np.ndarray, np.ndarray]]) -> None:
        self.groups = groups  # (adapter, rows, scales [n, 1])
        self._uploaded: dict[tuple[int, Any], tuple[Any, Any]] = {}

    @classmethod
    def for_spans(cls, spans: Sequence[tuple[int, int, AdapterStack]]) -> RowAdapters | None:
        """From (first row, end row, stack) per sequence; None when no row has an adapter."""
        rows: dict[str, tuple[LoraAdapter, list[np.ndarray], list[np.ndarray]]] = {}
        for start, end, stack in spans:
            for adapter, scale in stack:
                entry = rows.setdefault(adapter.key, (adapter, [], []))
                entry[1].append(np.arange(start, end))
                entry[2].append(np.full(end - start, scale, np.float32))
        if not rows:
            return None
        groups = []  # in key order: a row adds its deltas in the same order in any batch
        for _, (adapter, index_parts, scale_parts) in sorted(rows.items()):
            index = np.concatenate(index_parts)
            contiguous = index[-1] - index[0] + 1 == len(index)
            where = slice(int(index[0]), int(index[-1]) + 1) if contiguous else index
            groups.append((adapter, where, np.concatenate(scale_parts)[:, None]))
        return cls(groups)

    def apply(self, weight: Weight, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """`out` = weight(x) with each adapter's delta added to its rows (in place; device
        tensors left in bf16 are widened to float32 first)."""
        key = id(weight)
        if isinstance(x, np.ndarray):
            return self._apply_on_host(key, x, out)
        x, out = x.float(), out.float()  # a GPU's products and inputs may be bf16: add in float32
        if x.device.type == "cpu":  # the CPU's tensor path: the host's row-invariant kernel
            out = out.contiguous()
            self._apply_on_host(key, x.contiguous().numpy(), out.numpy())  # in place
            return out
        for adapter, rows, scales in self.groups:
            delta = adapter.deltas.get(key)
            if delta is None:
                continue
            a, b = delta.tensors(x.device)  # the delta's and the rows' copies on x's device
            where, row_scales = self._on_device(rows, scales, x.device)
            low = x[where] @ a.T  # [n, in] -> [n, R]
            low *= row_scales
            out[where] += low @ b.T  # [n, R] -> [n, out]
        return out

    def _apply_on_host(self, key: int, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Each row's deltas summed alone in a fixed order (dense_rows.c; without a compiler
        numpy one row at a time, whose products then have one shape whatever the batch)."""
        x = np.ascontiguousarray(x, np.float32)
        out = np.ascontiguousarray(out, np.float32)
        for adapter, rows, scales in self.groups:
            delta = adapter.deltas.get(key)
            if delta is not None:
                add_row_deltas(x, self._index(rows), scales, delta.a, delta.bt, out)
        return out

    def _index(self, rows: slice | np.ndarray) -> np.ndarray:
        """A group's rows as an int64 array, made once per forward pass."""
        if isinstance(rows, slice):
            cached = self._uploaded.get((id(rows), "index"))
            if cached is None:
                cached = (np.arange(rows.start, rows.stop, dtype=np.int64), None)
                self._uploaded[(id(rows), "index")] = cached
            return cached[0]
        return rows

    def _on_device(self, rows: slice | np.ndarray, scales: np.ndarray, device: Any):
        """Row index and scales as tensors on `device`, uploaded once per forward pass."""
        cached = self._uploaded.get((id(rows), device))
        if cached is None:
            import torch

            index = rows if isinstance(rows, slice) else torch.from_numpy(rows).to(device)
            cached = (index, torch.from_numpy(scales).to(device))
            self._uploaded[(id(rows), device)] = cached
        return cached


def add_row_deltas(
    x: np.ndarray,
    index: np.ndarray,
    scales: np.ndarray,
    a: np.ndarray,
    bt: np.ndarray,
    out: np.ndarray,
) -> None:
    """`out[index] += (x[index] @ a.T * scales) @ bt` in place, each row alone in rank
    order (dense_rows.c; without a compiler numpy one row at a time, whose products then
    have one shape whatever the batch): x `[T, in]`, scales `[n, 1]`, a `[R, in]`, bt
    `[R, out]`, out `[T, out]`, float32 C-contiguous."""
    kernel = dense_rows()
    if kernel is not None:
        kernel.lora(x, index, scales, a, bt, out)
        return
    for row, scale in zip(index, scales[:, 0], strict=True):
        low = x[row] @ a.T  # [in] -> [R]
        low *= scale
        out[row] += low @ bt  # [R] -> [out]
