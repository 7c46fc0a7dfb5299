"""The engine's own C kernels: built once per machine with the system's C compiler, loaded
with ctypes.

`paged_attention.c` is attention whose per-row result does not depend on the batch
(runtime/models/attention.py uses it for the host forward pass). It is compiled the first
time a process asks for it, into `LLMQ_CACHE_DIR` (default `~/.cache/llmq`) under a name
that hashes the source, the flags and this CPU's feature flags, so an edited source or
another CPU kind gets its own build and a later process only loads the file. `-fopenmp`
links libgomp by its soname, the one torch's wheel ships and loads: one OpenMP runtime per
process. The kernel runs on as many threads as runtime/kernels/core_share.py gives torch,
and on one where no torch backend shares the cores (the numpy backend's OpenBLAS threads
spin after each product: two spinning teams on two cores slowed a test 12x).

Where no compiler works, `paged_attention()` is None and attention keeps its numpy path
(rows then depend on their batch in the last bits); the reason is logged once.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.cache_dir import cache_dir, source_digest, write_atomically
from runtime.kernels.core_share import threads
from runtime.kernels.cpu import cpu_features

log = logging.getLogger("llmq.kernels")

SOURCE = Path(__file__).with_name("paged_attention.c")
# no -ffast-math: the order of every sum is the source's, on every row
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=256", "-fopenmp", "-shared", "-fPIC")
FLAGS += ("-fno-math-errno",)
DISABLE_ENV = "LLMQ_NUMPY_ATTENTION"  # "1": keep the numpy path (benches compare the two)

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p


# the pool's element type -> the build's extra flags (paged_attention.c's KV_HALF)
KV_BUILDS = {np.dtype(np.float32): (), np.dtype(np.float16): ("-DKV_HALF",)}


def _library_path(defines: tuple[str, ...]) -> Path:
    what = [source_digest(SOURCE), *FLAGS, *defines, *sorted(cpu_features().flags)]
    key = hashlib.sha256(" ".join(what).encode()).hexdigest()[:16]
    return cache_dir() / f"paged_attention-{key}.so"


def _compile(target: Path, defines: tuple[str, ...]) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or $CC) on PATH")

    def build(partial: Path) -> None:
        subprocess.run(
            [compiler, *FLAGS, *defines, "-o", str(partial), str(SOURCE), "-lm"],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )

    try:  # processes building at once never load half a file
        write_atomically(target, build)
    except subprocess.CalledProcessError as exc:
        raise OSError(f"{compiler} failed: {exc.stderr.strip()[-500:]}") from exc


@functools.cache
def _library(defines: tuple[str, ...]) -> ctypes.CDLL | None:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    target = _library_path(defines)
    try:
        if not target.exists():
            _compile(target, defines)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("native attention unavailable, using numpy's (%s)", exc)
        return None
    fn = lib.llmq_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64]
    fn.argtypes += [ctypes.c_int, _ptr]
    return lib


@dataclass(frozen=True)
class RowKeys:
    """Which keys each packed row sees: `slots[offset[t] : offset[t] + count[t]]` are row
    t's pool slots in position order. Built and checked once per forward pass; every layer
    of the pass reuses it."""

    slots: np.ndarray  # int64
    offset: np.ndarray  # [T] int64
    count: np.ndarray  # [T] int64, each >= 1
    max_count: int
    max_slot: int

    @classmethod
    def checked(cls, slots: np.ndarray, offset: np.ndarray, count: np.ndarray) -> RowKeys:
        slots, offset, count = (np.ascontiguousarray(a, np.int64) for a in (slots, offset, count))
        rows = len(offset)
        if len(count) != rows or (rows and count.min() < 1):
            raise ValueError("every row needs an offset and at least one key")
        if len(slots) and slots.min() < 0:
            raise ValueError("a slot is negative")
        if rows and (offset.min() < 0 or (offset + count).max() > len(slots)):
            raise ValueError("a row's slots run past the slot array")
        max_slot = int(slots.max()) if len(slots) else -1
        return cls(slots, offset, count, int(count.max()) if rows else 0, max_slot)


class PagedAttention:
    """`__call__` runs the kernel over numpy arrays, checking what it must not get wrong;
    one build per element type of the pool (float32 or float16)."""

    def __init__(self, kv_dtype: np.dtype, lib: ctypes.CDLL) -> None:
        self.kv_dtype = kv_dtype
        self._fn = lib.llmq_paged_attention

    def __call__(
        self,
        q: np.ndarray,  # [T, H, Dh] float32, rows may be strided
        keys: np.ndarray,  # [Hkv, slots, Dh] of the build's type, C-contiguous
        values: np.ndarray,
        rows: RowKeys,
    ) -> np.ndarray:
        n_rows, heads, head_dim = q.shape
        kv_heads, pool_slots, _ = keys.shape
        if q.dtype != np.float32 or q.strides[1:] != (4 * head_dim, 4):
            q = np.ascontiguousarray(q, np.float32)
        for name, a in (("keys", keys), ("values", values)):
            if a.dtype != self.kv_dtype or not a.flags.c_contiguous or a.shape != keys.shape:
                raise ValueError(f"{name} must be C-contiguous {self.kv_dtype} {keys.shape}")
        if len(rows.offset) != n_rows or rows.max_slot >= pool_slots:
            raise ValueError("the row keys do not fit these queries and this pool")
        out = np.empty((n_rows, heads * head_dim), np.float32)
        failed = self._fn(
            q.ctypes.data,
            q.strides[0] // 4,
            keys.ctypes.data,
            values.ctypes.data,
            pool_slots,
            rows.slots.ctypes.data,
            rows.offset.ctypes.data,
            rows.count.ctypes.data,
            n_rows,
            heads,
            kv_heads,
            head_dim,
            rows.max_count,
            threads(),
            out.ctypes.data,
        )
        if failed:
            raise MemoryError("paged attention could not allocate its score buffer")
        return out


def paged_attention(kv_dtype: np.dtype | type = np.float32) -> PagedAttention | None:
    """The kernel compiled for a pool of `kv_dtype`, or None where it cannot be built here."""
    return _kernel(np.dtype(kv_dtype))


@functools.cache
def _kernel(kv_dtype: np.dtype) -> PagedAttention | None:
    lib = _library(KV_BUILDS[kv_dtype])
    return PagedAttention(kv_dtype, lib) if lib is not None else None
