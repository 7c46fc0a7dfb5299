"""A cold load's repacking in C: GGUF blocks straight into the kernels' layouts.

runtime/kernels/repack.c turns Q4_K rows into lowbit_rows.c's 4-bit layout, Q8_0 / Q6_K rows
into int8_rows.c's grouped layout, and a Q8_0 / Q6_K head into lowbit_rows.c's int8 rows,
each row in one pass from the mapped file, bitwise what the numpy readers and packers in
gguf_blocks.py and native.py give (tests/runtime/test_repack.py). Every function returns
None where the C library cannot be built or the parts are not of its types; its caller
then keeps the numpy path.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from pathlib import Path

import numpy as np

from runtime.gguf_file import GGUFFile
from runtime.kernels.base import TensorPart
from runtime.kernels.core_share import threads
from runtime.kernels.gguf_blocks import Q
from runtime.kernels.native import (
    INT8_GROUP,
    INT8_GROUP_BYTES,
    LOWBIT_GROUP,
    LOWBIT_GROUP_BYTES,
    _library,
    lowbit_shape,
)

SOURCE = Path(__file__).with_name("repack.c")
INT8_TYPES = (Q.Q8_0, Q.Q6_K)  # what llmq_int8_groups and llmq_int8_head read

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
# A layer tensor's repack takes ~10 ms: on one thread, since a second one spun at the end of
# each for its descheduled partner on the shared 2-core EPYC (the 1B's Q4_K tensors: 1.13 s
# user time on two threads, 0.55 on one, the same wall time, load average 6). A head's
# repack is one long run, shared by core_share.threads() threads.


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = _library(SOURCE)
    if lib is None:
        return None
    lib.llmq_q4k_lowbit.restype = None
    lib.llmq_q4k_lowbit.argtypes = [_ptr, _i64, _ptr, _i64, _i64, ctypes.c_float, _ptr, _i64]
    lib.llmq_q4k_lowbit.argtypes += [ctypes.c_int]
    lib.llmq_int8_groups.restype = ctypes.c_int
    lib.llmq_int8_groups.argtypes = [_ptr, _i64, ctypes.c_int, _ptr, _i64, _i64]
    lib.llmq_int8_groups.argtypes += [ctypes.c_float, ctypes.c_int, _ptr, _ptr, _i64, ctypes.c_int]
    lib.llmq_int8_head.restype = ctypes.c_int
    lib.llmq_int8_head.argtypes = [_ptr, _i64, ctypes.c_int, _i64, _i64, _ptr, _i64, ctypes.c_int]
    lib.llmq_ranking.restype = ctypes.c_int
    lib.llmq_ranking.argtypes = lib.llmq_int8_head.argtypes
    return lib


def _source(f: GGUFFile, part: TensorPart) -> tuple[np.ndarray, int, int, np.ndarray | None]:
    """A part's raw rows `[N, row bytes]` (the mapped file), N, K and its row order."""
    blocks, _, shape = f.blocks(part.name)
    n, k = int(shape[0]), int(shape[1])
    raw = np.ascontiguousarray(np.asarray(blocks, np.uint8).reshape(n, -1))
    order = None
    if part.row_order is not None:
        order = np.ascontiguousarray(part.row_order, np.int64)
        if len(order) != n or (n and (order.min() < 0 or order.max() >= n)):
            raise ValueError(f"{part.name}: row order must pick each of its {n} rows")
    return raw, n, k, order


def _sources(f: GGUFFile, parts: list[TensorPart], types: tuple) -> list | None:
    """Each part's source where all are of `types` and share K; else None."""
    if not parts or any(f.blocks(p.name)[1] not in types for p in parts):
        return None
    sources = [_source(f, p) for p in parts]
    return sources if len({k for _, _, k, _ in sources}) == 1 else None


def _zeros(shape: tuple[int, ...], dtype=np.uint8) -> np.ndarray:
    """A zeroed array in its own anonymous mapping, of 4 KiB pages: numpy asks for huge
    pages for large arrays, and faulting those in (zeroed 2 MiB at a time, compacted for)
    took 1.08 s of system time for the 1B's 495 MiB of Q4_K layouts where 4 KiB pages took
    0.23, at a load average of 14. A model mapped from the prepared store has 4 KiB pages
    too."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(size, 1)), dtype, int(np.prod(shape))).reshape(shape)


def _addr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def q4k_lowbit(f: GGUFFile, parts: list[TensorPart]) -> np.ndarray | None:
    """native.pack_lowbit(concat of the parts' Q4_K codes, 4): `[groups, K / 32, 320]`."""
    lib = _lib()
    sources = _sources(f, parts, (Q.Q4_K,))
    if lib is None or sources is None:
        return None
    n, k = sum(s[1] for s in sources), sources[0][2]
    if k % 256:
        return None
    packed = _zeros(lowbit_shape(n, k, 4))  # padding rows: zero codes, scales and mins
    first = 0
    for part, (raw, rows, _, order) in zip(parts, sources, strict=True):
        order_at = _addr(order)
        out = (packed.ctypes.data, first, 1)  # one thread (see above)
        lib.llmq_q4k_lowbit(raw.ctypes.data, raw.shape[1], order_at, rows, k, part.scale, *out)
        first += rows
    assert packed.shape[-1] == LOWBIT_GROUP_BYTES[4]
    return packed


def int8_groups(f: GGUFFile, parts: list[TensorPart]) -> tuple[np.ndarray, np.ndarray] | None:
    """native.pack_int8_groups of the parts' Q8_0 / Q6_K codes and scales (BlockCodes.concat:
    a scale per 16 where any part has one): (packed, scales)."""
    lib = _lib()
    sources = _sources(f, parts, INT8_TYPES)
    if lib is None or sources is None:
        return None
    types = [int(f.blocks(p.name)[1]) for p in parts]
    n, k = sum(s[1] for s in sources), sources[0][2]
    if k % 256 and Q.Q6_K in types or k % 32:
        return None
    per = 2 if Q.Q6_K in types else 1
    groups = -(-n // INT8_GROUP)
    packed = _zeros((groups, k // 32, INT8_GROUP_BYTES))
    if n % INT8_GROUP:  # padding rows: code 0 (128 as stored), scale 0
        packed[-1] = 128
    scales = _zeros((groups, k // 32, per, INT8_GROUP), np.float32)
    first = 0
    for part, qtype, (raw, rows, _, order) in zip(parts, types, sources, strict=True):
        args = (raw.ctypes.data, raw.shape[1], qtype, _addr(order), rows, k, part.scale, per)
        out = (packed.ctypes.data, scales.ctypes.data, first, 1)
        if lib.llmq_int8_groups(*args, *out) != 0:
            return None
        first += rows
    return packed, scales


def int8_head(f: GGUFFile, name: str) -> np.ndarray | None:
    """A Q8_0 / Q6_K head requantized to int8 per row (torch_backend.Int8Weight.quantized)
    in native.pack_int8_rows' layout: `lowbit_shape(N, K, 8)`."""
    return _head(f, name, 8)


def ranking(f: GGUFFile, name: str) -> np.ndarray | None:
    """A Q8_0 / Q6_K head requantized to 4 bits a weight (gguf_blocks.quantize_groups) in
    native.pack_lowbit's layout: a large head's ranking (torch_backend.RescoredHead)."""
    return _head(f, name, 4)


def _head(f: GGUFFile, name: str, bits: int) -> np.ndarray | None:
    lib = _lib()
    sources = _sources(f, [TensorPart(name)], INT8_TYPES)
    if lib is None or sources is None:
        return None
    raw, n, k, _ = sources[0]
    qtype = int(f.blocks(name)[1])
    if k % 256 and qtype == Q.Q6_K or k % 32:
        return None
    if bits == 4:  # padding rows: zero codes, scales and mins
        packed = _zeros(lowbit_shape(n, k, 4))
    else:
        packed = _zeros(lowbit_shape(n, k, 8))
        if n % LOWBIT_GROUP:  # padding rows: code 0 (128 as stored), scale 0
            packed[-1, : -4 * LOWBIT_GROUP] = 128
            packed[-1, -4 * LOWBIT_GROUP :] = 0
    fill = lib.llmq_ranking if bits == 4 else lib.llmq_int8_head
    if fill(raw.ctypes.data, raw.shape[1], qtype, n, k, packed.ctypes.data, 0, threads()) != 0:
        return None
    return packed
