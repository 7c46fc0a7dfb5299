"""The engine's own C kernels: built once per machine with the system's C compiler, loaded
with ctypes.

- `paged_attention.c` is attention whose per-row result does not depend on the batch
  (runtime/models/attention.py uses it for the host forward pass).
- `int8_rows.c` is the product with int8-per-row weights (the LM head where int8 holds it,
  runtime/kernels/torch_backend.py `Int8Weight`): integer dot products over activations
  rounded to int8 per block of 32, as llama.cpp multiplies its Q8_0 head; and with a file's
  Q8_0 / Q6_K codes (and Q3_K, Q2_K, IQ4_NL, IQ4_XS, MXFP4), a row at a time or 16 rows
  side by side (`pack_int8_groups`, 512-bit VNNI where the build has it); its NIBBLE_TABLE
  builds take 4-bit indices into a type's values (`pack_nibble_groups`, `nibble_rows`).
- `lowbit_rows.c` is the product with GGUF's 4- and 5-bit weights (Q4_0, Q4_1, Q4_K,
  Q5_0, Q5_1, Q5_K; `LowBitWeight` there),
  over activations rounded the same way, as llama.cpp multiplies Q4_1 by Q8_1;
  `pack_lowbit` lays the weights out for it.
- `dense_rows.c` multiplies fp16 weights (`Fp16RowsWeight`) and adds LoRA deltas
  (runtime/lora.py) in one fixed order per row, where BLAS and fbgemm block by batch.

Each is compiled the first time a process asks for it, into `LLMQ_CACHE_DIR` (default
`~/.cache/llmq`) under a name that hashes the source, the flags and this CPU's feature
flags, so an edited source or another CPU kind gets its own build and a later process only
loads the file. `-fopenmp` links libgomp by its soname, the one torch's wheel ships and
loads: one OpenMP runtime per process. The kernels run on as many threads as
runtime/kernels/core_share.py gives torch, and on one where no torch backend shares the
cores (the numpy backend's OpenBLAS threads spin after each product: two spinning teams on
two cores slowed a test 12x).

Where no compiler works, `paged_attention()`, `int8_rows()`, `lowbit_rows()` and
`dense_rows()` are None and
their callers keep their numpy or torch path; the reason is logged once.
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
from runtime.kernels.cpu_features import build_flags, cpu_features
from runtime.kernels.gguf_blocks import GroupQuantized

log = logging.getLogger("llmq.kernels")

ATTENTION_SOURCE = Path(__file__).with_name("paged_attention.c")
INT8_ROWS_SOURCE = Path(__file__).with_name("int8_rows.c")
LOWBIT_ROWS_SOURCE = Path(__file__).with_name("lowbit_rows.c")
DENSE_ROWS_SOURCE = Path(__file__).with_name("dense_rows.c")
# no -ffast-math: the order of every sum is the source's, on every row
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=256", "-fopenmp", "-shared", "-fPIC")
FLAGS += ("-fno-math-errno",)
DISABLE_ENV = "LLMQ_NUMPY_ATTENTION"  # "1": keep the numpy path (benches compare the two)

_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p
_c_char = ctypes.c_char
_addressof = ctypes.addressof


def address(a: np.ndarray) -> int:
    """Where a C-contiguous array's data starts. `a.ctypes.data` builds numpy's ctypes
    helper object every time (~2 us on the 2-core AVX2 EPYC); a decode step of SmolLM2 took
    ~700 of them, 1.4 ms of a 13 ms step. A writable array's buffer gives it in ~0.7 us;
    read-only memory (a mapped file) takes numpy's way."""
    try:
        return _addressof(_c_char.from_buffer(a))
    except (TypeError, ValueError):  # read-only, or empty
        return a.ctypes.data


# the pool's element type -> the build's extra flags (paged_attention.c's KV_HALF)
KV_BUILDS = {np.dtype(np.float32): (), np.dtype(np.float16): ("-DKV_HALF",)}


def _library_path(source: Path, defines: tuple[str, ...]) -> Path:
    what = [source_digest(source), *FLAGS, *build_flags(), *defines, *sorted(cpu_features().flags)]
    key = hashlib.sha256(" ".join(what).encode()).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{key}.so"


def _compile(source: Path, target: Path, defines: tuple[str, ...]) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or $CC) on PATH")

    def build(partial: Path) -> None:
        subprocess.run(
            [compiler, *FLAGS, *build_flags(), *defines, "-o", str(partial), str(source), "-lm"],
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
def _library(source: Path, defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    target = _library_path(source, defines)
    try:
        if not target.exists():
            _compile(source, target, defines)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning(
            "native kernel %s unavailable, its caller keeps its own path (%s)", source.name, exc
        )
        return None


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

    @functools.cached_property
    def addresses(self) -> tuple[int, int, int]:
        """(slots, offset, count) as the kernel takes them; every layer of a pass reuses them."""
        return address(self.slots), address(self.offset), address(self.count)


class PagedAttention:
    """`__call__` runs the kernel over numpy arrays, checking what it must not get wrong;
    one build per element type of the pool (float32 or float16)."""

    def __init__(self, kv_dtype: np.dtype, lib: ctypes.CDLL) -> None:
        self.kv_dtype = kv_dtype
        self._fn = lib.llmq_paged_attention
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64]
        self._fn.argtypes += [_i64, _i64, ctypes.c_float, _ptr, ctypes.c_int, _ptr]

    def __call__(
        self,
        q: np.ndarray,  # [T, H, Dh] float32, rows may be strided
        keys: np.ndarray,  # [Hkv, slots, Dh] of the build's type, C-contiguous
        values: np.ndarray,
        rows: RowKeys,
        softcap: float | None = None,  # Gemma 2's attention logit cap
        sinks: np.ndarray | None = None,  # [H] float32: gpt-oss's per-head sink logits
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
        if sinks is not None and (sinks.dtype != np.float32 or sinks.shape != (heads,)):
            raise ValueError(f"sinks must be float32 ({heads},), got {sinks.dtype} {sinks.shape}")
        out = np.empty((n_rows, heads * head_dim), np.float32)
        failed = self._fn(
            address(q),
            q.strides[0] // 4,
            address(keys),
            address(values),
            pool_slots,
            *rows.addresses,
            n_rows,
            heads,
            kv_heads,
            head_dim,
            rows.max_count,
            softcap or 0.0,
            None if sinks is None else address(np.ascontiguousarray(sinks)),
            threads(),
            address(out),
        )
        if failed:
            raise MemoryError("paged attention could not allocate its score buffer")
        return out


def paged_attention(kv_dtype: np.dtype | type = np.float32) -> PagedAttention | None:
    """The kernel compiled for a pool of `kv_dtype`, or None where it cannot be built here."""
    return _kernel(np.dtype(kv_dtype))


@functools.cache
def _kernel(kv_dtype: np.dtype) -> PagedAttention | None:
    if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
        return None
    lib = _library(ATTENTION_SOURCE, KV_BUILDS[kv_dtype])
    return PagedAttention(kv_dtype, lib) if lib is not None else None


INT8_BLOCK = 32  # int8_rows.c quantizes activations per this many values: K must divide by it
INT8_ENV = "LLMQ_TORCH_INT8"  # "1": int8 weights keep torch's kernel (benches compare the two)


class Int8Rows:
    """`__call__` multiplies float32 rows by int8-per-row weights (int8_rows.c)."""

    def __init__(self, lib: ctypes.CDLL, group_bytes: int = 512) -> None:
        self.group_bytes = group_bytes  # a grouped block's bytes: 256 in a nibble build
        self._fn = lib.llmq_int8_rows
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _i64, ctypes.c_int, _ptr, _ptr]
        self._blocks = lib.llmq_int8_blocks
        self._blocks.restype = ctypes.c_int
        self._blocks.argtypes = [_ptr, _ptr, ctypes.c_int, _i64, _i64, _ptr, _ptr, _i64, _i64]
        self._blocks.argtypes += [ctypes.c_int]
        self._blocks.argtypes += [_ptr, _ptr]
        self._groups = lib.llmq_int8_groups
        self._groups.restype = ctypes.c_int
        self._groups.argtypes = list(self._blocks.argtypes)

    def bind_groups(
        self, packed: np.ndarray, scales: np.ndarray, n: int, input_scale: np.ndarray | None
    ) -> Int8GroupsProduct:
        """The product with one weight `pack_int8_groups` laid out (`[n, K]`)."""
        return Int8GroupsProduct(self, packed, scales, n, input_scale)

    @staticmethod
    def accepts(in_features: int) -> bool:
        return in_features % INT8_BLOCK == 0

    def blocks(
        self,
        x: np.ndarray,
        codes: np.ndarray,
        scales: np.ndarray,
        input_scale: np.ndarray | None = None,
        fine: bool = False,
    ) -> np.ndarray:
        """x `[T, K]` float32 (times `input_scale` `[K]` first) times a file's own codes `[N, K]`
        int8 with float32 `scales` `[N, K / 32]` (Q8_0) or `[N, K / 16]` (Q6_K) -> `[T, N]`;
        `fine`: x rounded in two passes (what one int8 pass misses, rounded again)."""
        x = np.ascontiguousarray(x, np.float32)
        rows, k = x.shape
        n = codes.shape[0]
        if codes.dtype != np.int8 or not codes.flags.c_contiguous or codes.shape[1] != k:
            raise ValueError(f"codes must be C-contiguous int8 [N, {k}]")
        if not self.accepts(k):
            raise ValueError(f"K = {k} is not a multiple of {INT8_BLOCK}")
        per_block = scales.shape[1] * INT8_BLOCK // k if scales.ndim == 2 else 0
        if (
            scales.dtype != np.float32
            or not scales.flags.c_contiguous
            or per_block not in (1, 2)
            or scales.shape != (n, k // INT8_BLOCK * per_block)
        ):
            raise ValueError(f"scales must be C-contiguous float32 [{n}, {k} / 32 or / 16]")
        if input_scale is not None and (
            input_scale.dtype != np.float32 or input_scale.shape != (k,)
        ):
            raise ValueError(f"input_scale must be float32 [{k}]")
        if input_scale is not None:
            input_scale = np.ascontiguousarray(input_scale)  # kept alive through the call
        work = np.empty((2 if fine else 1) * rows * (2 * k + 4 * (k // INT8_BLOCK)), np.uint8)
        out = np.empty((rows, n), np.float32)
        self._blocks(
            address(x),
            None if input_scale is None else address(input_scale),
            int(fine),
            rows,
            k,
            address(codes),
            address(scales),
            per_block,
            n,
            threads(),
            address(work),
            address(out),
        )
        return out

    def __call__(self, x: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """x `[T, K]` float32, codes `[N, K]` int8, scales `[N]` float32 -> `[T, N]`."""
        x = np.ascontiguousarray(x, np.float32)
        rows, k = x.shape
        n = codes.shape[0]
        if codes.dtype != np.int8 or not codes.flags.c_contiguous or codes.shape[1] != k:
            raise ValueError(f"codes must be C-contiguous int8 [N, {k}]")
        if scales.dtype != np.float32 or scales.shape != (n,) or not scales.flags.c_contiguous:
            raise ValueError(f"scales must be C-contiguous float32 [{n}]")
        if not self.accepts(k):
            raise ValueError(f"K = {k} is not a multiple of {INT8_BLOCK}")
        work = np.empty(rows * (2 * k + 4 * (k // INT8_BLOCK)), np.uint8)  # the rounded rows
        out = np.empty((rows, n), np.float32)
        self._fn(
            address(x),
            rows,
            k,
            address(codes),
            address(scales),
            n,
            threads(),
            address(work),
            address(out),
        )
        return out


INT8_GROUP = 16  # weight rows side by side in int8_rows.c's grouped layout
INT8_GROUP_BYTES = 512  # one group's block of 32 columns


def pack_int8_groups(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8_rows.c's grouped layout of a file's codes `[N, K]` int8 with scales `[N, K / 32]`
    or `[N, K / 16]` float32: (packed `[N16 / 16, K / 32, 512]` uint8, each code plus 128,
    16 rows side by side; scales `[N16 / 16, K / 32, per_block, 16]` float32), N16 being N
    rounded up to 16 with zero rows."""
    n, k = codes.shape
    blocks, per_block = k // INT8_BLOCK, scales.shape[1] * INT8_BLOCK // k
    pad = -n % INT8_GROUP
    if pad:
        codes = np.concatenate([codes, np.zeros((pad, k), np.int8)])
        scales = np.concatenate([scales, np.zeros((pad, scales.shape[1]), np.float32)])
    groups = (n + pad) // INT8_GROUP
    shifted = (codes.view(np.uint8) ^ np.uint8(128)).reshape(groups, INT8_GROUP, blocks, 8, 4)
    packed = np.ascontiguousarray(shifted.transpose(0, 2, 3, 1, 4))  # [g, b, t, j, i]
    grouped = scales.astype(np.float32).reshape(groups, INT8_GROUP, blocks, per_block)
    return (
        packed.reshape(groups, blocks, INT8_GROUP_BYTES),
        np.ascontiguousarray(grouped.transpose(0, 2, 3, 1)),  # [g, b, per_block, j]
    )


class Int8GroupsProduct:
    """One weight in int8_rows.c's grouped layout bound to the kernel: checked, and its
    addresses taken, once (a decode step makes dozens of these products)."""

    def __init__(
        self,
        kernel: Int8Rows,
        packed: np.ndarray,
        scales: np.ndarray,
        n: int,
        input_scale: np.ndarray | None,
    ) -> None:
        groups, blocks, size = packed.shape
        k = blocks * INT8_BLOCK
        if packed.dtype != np.uint8 or not packed.flags.c_contiguous or size != kernel.group_bytes:
            shape = f"[N / 16, K / 32, {kernel.group_bytes}]"
            raise ValueError(f"packed must be C-contiguous uint8 {shape}")
        if groups != -(-n // INT8_GROUP):
            needed = -(-n // INT8_GROUP)
            raise ValueError(f"packed holds {groups} groups of 16 rows; {n} rows take {needed}")
        if (
            scales.dtype != np.float32
            or not scales.flags.c_contiguous
            or scales.shape[:2] != (groups, blocks)
            or scales.shape[2] not in (1, 2)
            or scales.shape[3] != INT8_GROUP
        ):
            shape = f"[{groups}, {blocks}, 1 or 2, 16]"
            raise ValueError(f"scales must be C-contiguous float32 {shape}")
        if input_scale is not None:
            if input_scale.dtype != np.float32 or input_scale.shape != (k,):
                raise ValueError(f"input_scale must be float32 [{k}]")
            input_scale = np.ascontiguousarray(input_scale)
        self._fn, self.n, self.k, self.per_block = kernel._groups, n, k, scales.shape[2]
        self._arrays = (packed, scales, input_scale)  # kept alive while their addresses are used
        self._packed, self._scales = address(packed), address(scales)
        self._scale = None if input_scale is None else address(input_scale)

    def __call__(self, x: np.ndarray, fine: bool = False) -> np.ndarray:
        """x `[T, K]` float32 -> `[T, n]`; `fine`: x rounded in two passes."""
        x = np.ascontiguousarray(x, np.float32)
        rows, k = x.shape
        if k != self.k:
            raise ValueError(f"x must have {self.k} columns, got {k}")
        work = np.empty((2 if fine else 1) * rows * (k + 12 * (k // INT8_BLOCK)), np.uint8)
        out = np.empty((rows, self.n), np.float32)
        self._fn(
            address(x),
            self._scale,
            int(fine),
            rows,
            k,
            self._packed,
            self._scales,
            self.per_block,
            self.n,
            threads(),
            address(work),
            address(out),
        )
        return out


# int8_rows.c's nibble builds (-DNIBBLE_TABLE): each type's int8 values, indexed by a nibble
NIBBLE_TABLES = {
    "iq4": (1, (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)),
    "mxfp4": (2, (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)),
    "signed4": (3, (0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1)),
}


def pack_nibble_groups(
    codes: np.ndarray, scales: np.ndarray, table: str
) -> tuple[np.ndarray, np.ndarray]:
    """`pack_int8_groups`' layout with each code as its 4-bit index into the table
    (int8_rows.c's NIBBLE_TABLE build): packed `[N16 / 16, K / 32, 256]` uint8 (steps c and
    c + 4 in one byte's low and high nibble), scales as there. Every code must be in the
    table."""
    values = np.array(NIBBLE_TABLES[table][1], np.int16)
    index = np.full(256, 255, np.uint8)  # the first index of each value; 255: not held
    for i in range(15, -1, -1):
        index[values[i] & 255] = i
    nibbles = index[codes.view(np.uint8)]
    if (nibbles == 255).any():
        raise ValueError(f"a code is not in the {table} table")
    n, k = codes.shape
    blocks = k // INT8_BLOCK
    pad = -n % INT8_GROUP
    if pad:
        nibbles = np.concatenate([nibbles, np.zeros((pad, k), np.uint8)])
        scales = np.concatenate([scales, np.zeros((pad, scales.shape[1]), np.float32)])
    groups = (n + pad) // INT8_GROUP
    steps = nibbles.reshape(groups, INT8_GROUP, blocks, 8, 4).transpose(0, 2, 3, 1, 4)
    packed = steps[:, :, :4] | (steps[:, :, 4:] << 4)  # [g, b, c, j, i]
    per_block = scales.shape[1] * INT8_BLOCK // k
    grouped = scales.astype(np.float32).reshape(groups, INT8_GROUP, blocks, per_block)
    return (
        np.ascontiguousarray(packed).reshape(groups, blocks, 256),
        np.ascontiguousarray(grouped.transpose(0, 2, 3, 1)),
    )


@functools.cache
def nibble_rows(table: str) -> Int8Rows | None:
    """int8_rows.c built for 4-bit indices into `table` (NIBBLE_TABLES), or None where it
    cannot be built here."""
    if os.environ.get(INT8_ENV, "") not in ("", "0"):
        return None
    lib = _library(INT8_ROWS_SOURCE, (f"-DNIBBLE_TABLE={NIBBLE_TABLES[table][0]}",))
    return Int8Rows(lib, 256) if lib is not None else None


@functools.cache
def int8_rows() -> Int8Rows | None:
    """The int8-weight product compiled for this CPU, or None where it cannot be built here
    (or `LLMQ_TORCH_INT8=1` asks for torch's)."""
    if os.environ.get(INT8_ENV, "") not in ("", "0"):
        return None
    lib = _library(INT8_ROWS_SOURCE)
    return Int8Rows(lib) if lib is not None else None


LOWBIT_ENV = "LLMQ_TORCH_INT4"  # "1": 4- and 5-bit weights keep torch's kernels (benches)
LOWBIT_GROUP = 16  # weight rows packed side by side (lowbit_rows.c's lanes)
# bytes of one group's block of 32 columns: codes, then 16 half scales and 16 half mins
# (8-bit: the codes only; the group's 16 float32 row scales follow its blocks)
LOWBIT_GROUP_BYTES = {4: 320, 5: 384, 8: 512}


def lowbit_shape(n: int, k: int, bits: int) -> tuple[int, ...]:
    """The packed array's shape for `n` rows of `k` weights of `bits` bits."""
    groups, blocks = -(-n // LOWBIT_GROUP), k // INT8_BLOCK
    if bits == 8:
        return (groups, blocks * LOWBIT_GROUP_BYTES[8] + 4 * LOWBIT_GROUP)
    return (groups, blocks, LOWBIT_GROUP_BYTES[bits])


def _packed_k(shape: tuple[int, ...], bits: int) -> int:
    """The K of a packed weight's shape (`lowbit_shape`'s inverse in K)."""
    if bits == 8:
        return (shape[1] - 4 * LOWBIT_GROUP) // LOWBIT_GROUP_BYTES[8] * INT8_BLOCK
    return shape[1] * INT8_BLOCK


def _whole_groups(*arrays: np.ndarray) -> list[np.ndarray]:
    """`arrays` (rows first) with zero rows added up to a multiple of LOWBIT_GROUP."""
    pad = -len(arrays[0]) % LOWBIT_GROUP
    return [np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) for a in arrays]


def pack_int8_rows(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """lowbit_rows.c's 8-bit layout of int8 rows `codes` `[N, K]` with a float32 scale a
    row: each code plus 128 as a byte, 16 rows side by side (see the layout there)."""
    n, k = codes.shape
    groups, blocks = -(-n // LOWBIT_GROUP), k // INT8_BLOCK
    codes, scales = _whole_groups(codes, np.asarray(scales, np.float32))
    shifted = (codes.astype(np.int16) + 128).astype(np.uint8)
    steps = shifted.reshape(groups, LOWBIT_GROUP, blocks, 8, 4)  # [g, j, b, t, i]
    packed = np.empty(lowbit_shape(n, k, 8), np.uint8)
    body = blocks * LOWBIT_GROUP_BYTES[8]
    packed[:, :body] = steps.transpose(0, 2, 3, 1, 4).reshape(groups, body)
    packed[:, body:] = scales.reshape(groups, -1).view(np.uint8)
    return packed


def pack_lowbit(q: GroupQuantized, bits: int) -> np.ndarray:
    """lowbit_rows.c's layout of `q` (codes below 2**bits; see the layout there):
    `[groups, K / 32, LOWBIT_GROUP_BYTES[bits]]` uint8. Rows are padded to a multiple of
    16 with zeros; scales and mins are kept as IEEE half (exactly the file's for Q4_0, Q4_1,
    Q5_0 and Q5_1, 11 significant bits of Q4_K's products)."""
    n, k = q.shape
    groups, blocks, size = -(-n // LOWBIT_GROUP), k // INT8_BLOCK, LOWBIT_GROUP_BYTES[bits]
    codes, scales, mins = _whole_groups(q.codes, q.scales, q.mins)
    grouped = codes.reshape(groups, LOWBIT_GROUP, blocks, 2, 4, 4)  # [g, j, b, half, c, i]
    nibbles = (grouped[:, :, :, 0] & 15) | ((grouped[:, :, :, 1] & 15) << 4)  # [g, j, b, c, i]
    packed = np.empty((groups, blocks, size), np.uint8)
    packed[..., :256] = nibbles.transpose(0, 2, 3, 1, 4).reshape(groups, blocks, 256)
    if bits == 5:  # plane t, bit j * 4 + i: bit 4 of row j's code 4t + i
        fifth = (codes.reshape(groups, LOWBIT_GROUP, blocks, 8, 4) >> 4) & 1  # [g, j, b, t, i]
        planes = fifth.transpose(0, 2, 3, 1, 4).reshape(groups, blocks, 8, 64)
        packed[..., 256:320] = np.packbits(planes, axis=-1, bitorder="little").reshape(
            groups, blocks, 64
        )
    for start, values in ((size - 64, scales), (size - 32, mins)):
        half = values.astype(np.float16).reshape(groups, LOWBIT_GROUP, blocks).transpose(0, 2, 1)
        packed[..., start : start + 32] = np.ascontiguousarray(half).view(np.uint8)
    return packed


class LowBitRows:
    """`__call__` multiplies float32 rows by `bits`-bit weights packed by `pack_lowbit`;
    `bind` checks a weight once and gives its product (what the forward pass calls)."""

    def __init__(self, lib: ctypes.CDLL, bits: int) -> None:
        self.bits = bits
        self._fn = lib.llmq_lowbit_rows
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_ptr, _i64, _i64, ctypes.c_float, _ptr, _ptr, _i64, ctypes.c_int, _ptr]

    def bind(
        self, packed: np.ndarray, n: int, input_scale: np.ndarray | None = None
    ) -> LowBitProduct:
        """The product with one packed weight `[n, K]` (times `input_scale` `[K]` first)."""
        return LowBitProduct(self, packed, n, input_scale)

    def __call__(
        self, x: np.ndarray, packed: np.ndarray, n: int, input_scale: np.ndarray | None = None
    ) -> np.ndarray:
        """x `[T, K]` float32 (times `input_scale` `[K]` first) -> `[T, n]`."""
        return self.bind(packed, n, input_scale)(x)


class LowBitProduct:
    """One packed weight bound to the kernel: checked, and its addresses taken, once. A
    decode step makes 120 of these products for SmolLM2; per call only the rows are
    checked (tens of microseconds of checks and addresses were most of a small one)."""

    def __init__(
        self, kernel: LowBitRows, packed: np.ndarray, n: int, input_scale: np.ndarray | None
    ) -> None:
        if packed.dtype != np.uint8 or packed.ndim < 2 or not packed.flags.c_contiguous:
            raise ValueError("packed must be C-contiguous uint8 (`lowbit_shape`)")
        k = _packed_k(packed.shape, kernel.bits)
        shape = lowbit_shape(n, k, kernel.bits)
        if packed.shape != shape:
            raise ValueError(f"packed must be C-contiguous uint8 {shape}")
        if input_scale is not None:
            if input_scale.dtype != np.float32 or input_scale.shape != (k,):
                raise ValueError(f"input_scale must be float32 [{k}]")
            input_scale = np.ascontiguousarray(input_scale)
        self._fn, self.n, self.k = kernel._fn, n, k
        self._arrays = (packed, input_scale)  # kept alive while their addresses are used
        self._packed = address(packed)
        self._scale = None if input_scale is None else address(input_scale)

    def __call__(self, x: np.ndarray, norm_eps: float | None = None) -> np.ndarray:
        """x `[T, K]` float32 -> `[T, n]`; with `norm_eps`, each row RMS-normalized first
        (runtime/models/base.py `rms_normalize`, done here as the rows are rounded to int8:
        no normalized copy, and 2 of a layer's 4 products need one)."""
        x = np.ascontiguousarray(x, np.float32)
        rows, k = x.shape
        if k != self.k:
            raise ValueError(f"packed must be C-contiguous uint8 for K = {k}, it holds {self.k}")
        if norm_eps is not None and not norm_eps >= 0.0:
            raise ValueError(f"norm_eps must be >= 0, got {norm_eps}")
        eps = -1.0 if norm_eps is None else norm_eps
        out = np.empty((rows, self.n), np.float32)
        failed = self._fn(
            address(x), rows, k, eps, self._scale, self._packed, self.n, threads(), address(out)
        )
        if failed:
            raise MemoryError("the low-bit product could not allocate its quantized rows")
        return out


def lowbit_builds() -> bool:
    """Whether both the 4- and the 5-bit products build here (and are not turned off)."""
    return lowbit_rows(4) is not None and lowbit_rows(5) is not None


@functools.cache
def lowbit_rows(bits: int = 4) -> LowBitRows | None:
    """The product for `bits`-bit codes (4, 5, or 8 where the CPU has VNNI) compiled for
    this CPU, or None where it cannot be built here (or `LLMQ_TORCH_INT4=1` asks for
    torch's kernels)."""
    if os.environ.get(INT8_ENV if bits == 8 else LOWBIT_ENV, "") not in ("", "0"):
        return None
    if bits == 8 and not {"avx512_vnni", "avx_vnni"} & cpu_features().flags:
        return None  # vpmaddubsw would saturate: int8_rows.c takes 8-bit weights there
    lib = _library(LOWBIT_ROWS_SOURCE, (f"-DCODE_BITS={bits}",))
    return LowBitRows(lib, bits) if lib is not None else None


class DenseRows:
    """dense_rows.c: fp16-weight products and LoRA deltas, each row in a fixed order."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fp16 = lib.llmq_fp16_rows
        self._fp16.restype = ctypes.c_int
        self._fp16.argtypes = [_ptr, _i64, _i64, _ptr, _i64, ctypes.c_int, _ptr]
        self._lora = lib.llmq_lora_rows
        self._lora.restype = ctypes.c_int
        self._lora.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64]
        self._lora.argtypes += [ctypes.c_int, _ptr]

    @staticmethod
    def accepts(in_features: int) -> bool:
        return in_features % 8 == 0

    def fp16(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """x `[T, K]` float32 times `weight` `[N, K]` float16 (C-contiguous) -> `[T, N]`."""
        x = np.ascontiguousarray(x, np.float32)
        rows, k = x.shape
        if weight.dtype != np.float16 or not weight.flags.c_contiguous or weight.shape[1] != k:
            raise ValueError(f"weight must be C-contiguous float16 [N, {k}]")
        if not self.accepts(k):
            raise ValueError(f"K = {k} is not a multiple of 8")
        n = weight.shape[0]
        out = np.empty((rows, n), np.float32)
        self._fp16(address(x), rows, k, address(weight), n, threads(), address(out))
        return out

    def lora(
        self,
        x: np.ndarray,
        rows: np.ndarray,
        scales: np.ndarray,
        a: np.ndarray,
        bt: np.ndarray,
        out: np.ndarray,
    ) -> None:
        """`out[rows] += (x[rows] @ a.T * scales) @ bt` in place, each row alone: x `[T, K]`,
        rows `[n]` int64, scales `[n]`, a `[R, K]`, bt `[R, N]` (B transposed), out `[T, N]`
        float32 C-contiguous."""
        t, k = x.shape
        rank, n = bt.shape
        if not (out.dtype == np.float32 and out.flags.c_contiguous and out.shape == (t, n)):
            raise ValueError(f"out must be C-contiguous float32 [{t}, {n}]")
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            raise ValueError("x must be C-contiguous float32")
        if a.shape != (rank, k) or a.dtype != np.float32 or bt.dtype != np.float32:
            raise ValueError(f"a must be float32 [{rank}, {k}] and bt float32 [{rank}, {n}]")
        if len(rows) != len(scales) or (len(rows) and (rows.min() < 0 or rows.max() >= t)):
            raise ValueError("every row needs a scale and must lie inside x")
        rows = np.ascontiguousarray(rows, np.int64)
        scales = np.ascontiguousarray(scales, np.float32).reshape(-1)
        a, bt = np.ascontiguousarray(a), np.ascontiguousarray(bt)
        failed = self._lora(
            address(x),
            k,
            address(rows),
            address(scales),
            len(rows),
            address(a),
            rank,
            address(bt),
            n,
            threads(),
            address(out),
        )
        if failed:
            raise MemoryError("the LoRA product could not allocate its low-rank rows")


@functools.cache
def dense_rows() -> DenseRows | None:
    """dense_rows.c compiled for this CPU, or None where it cannot be built here."""
    lib = _library(DENSE_ROWS_SOURCE)
    return DenseRows(lib) if lib is not None else None
