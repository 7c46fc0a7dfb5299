"""GGUF's 4-bit block formats read as group-wise codes, scales and mins, without floats.

Q4_0, Q4_1 and Q4_K all describe each run of 32 weights along a row as `code * scale + min`
with a 4-bit code: Q4_0 with `min = -8 * scale`, Q4_K with a 6-bit scale and min per
32-weight sub-block times the super-block's two float16 factors. Reading them as that one
form lets a backend build its own int4 layout straight from the file's nibbles; gguf's
`dequantize` (float32 for the whole tensor) stays the reference the tests compare with.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

GROUP_SIZE = 32  # weights per (scale, min) pair in every 4-bit type below
Q = gguf.GGMLQuantizationType
FOUR_BIT_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
FIVE_BIT_TYPES = frozenset({Q.Q5_0, Q.Q5_1})
# read as signed 8-bit codes with a float32 scale per 32 (Q8_0) or per 16 (Q6_K) weights
EIGHT_BIT_TYPES = frozenset({Q.Q8_0, Q.Q6_K})


@dataclass
class GroupQuantized:
    """Rows of `code * scale + min`: codes `[N, K]` uint8 in 0..15 (0..31 read from a
    5-bit type), scales/mins `[N, K/32]`."""

    codes: np.ndarray
    scales: np.ndarray  # float32
    mins: np.ndarray  # float32

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def dequantize(self) -> np.ndarray:
        """float32 `[N, K]` (for tests and for backends that want dense weights)."""
        n, k = self.codes.shape
        grouped = self.codes.reshape(n, k // GROUP_SIZE, GROUP_SIZE).astype(np.float32)
        return (grouped * self.scales[..., None] + self.mins[..., None]).reshape(n, k)

    def take_rows(self, order: np.ndarray) -> GroupQuantized:
        return GroupQuantized(self.codes[order], self.scales[order], self.mins[order])

    def scaled(self, factor: float) -> GroupQuantized:
        """Every value times `factor` (exact up to float32 rounding of scale and min)."""
        f = np.float32(factor)
        return GroupQuantized(self.codes, self.scales * f, self.mins * f)

    @staticmethod
    def concat(parts: list[GroupQuantized]) -> GroupQuantized:
        return GroupQuantized(
            np.concatenate([p.codes for p in parts]),
            np.concatenate([p.scales for p in parts]),
            np.concatenate([p.mins for p in parts]),
        )


def read_four_bit(blocks: np.ndarray, qtype: Q, shape: tuple[int, int]) -> GroupQuantized:
    """Decode a 4-bit tensor's raw bytes (`[N, bytes per row]` uint8) into `GroupQuantized`."""
    n, k = shape
    if qtype == Q.Q4_K:
        return _read_q4_k(np.asarray(blocks, np.uint8).reshape(n, k // 256, 144), n, k)
    if qtype in (Q.Q4_0, Q.Q4_1):
        block_bytes = 18 if qtype == Q.Q4_0 else 20
        raw = np.asarray(blocks, np.uint8).reshape(n, k // GROUP_SIZE, block_bytes)
        scales = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, G]
        if qtype == Q.Q4_0:
            mins = scales * np.float32(-8)
        else:
            mins = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = raw[..., block_bytes - 16 :]  # [N, G, 16]: weight j low, weight j+16 high
        codes = np.concatenate([packed & 15, packed >> 4], axis=-1)  # [N, G, 32]
        return GroupQuantized(codes.reshape(n, k), scales, mins)
    raise ValueError(f"{qtype.name} is not a 4-bit block type")


def read_five_bit(blocks: np.ndarray, qtype: Q, shape: tuple[int, int]) -> GroupQuantized:
    """Decode Q5_0 (`(code - 16) * scale`) or Q5_1 (`code * scale + min`) raw bytes: a
    float16 scale (and min), 32 fifth bits (bit j is weight j's), 16 bytes of nibbles
    (weight j low, weight j + 16 high)."""
    if qtype not in FIVE_BIT_TYPES:
        raise ValueError(f"{qtype.name} is not a 5-bit block type")
    n, k = shape
    block_bytes = 22 if qtype == Q.Q5_0 else 24
    raw = np.asarray(blocks, np.uint8).reshape(n, k // GROUP_SIZE, block_bytes)
    scales = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == Q.Q5_0:
        mins = scales * np.float32(-16)
    else:
        mins = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    high_at = block_bytes - 20
    fifth = np.unpackbits(raw[..., high_at : high_at + 4], axis=-1, bitorder="little")
    packed = raw[..., block_bytes - 16 :]
    codes = np.concatenate([packed & 15, packed >> 4], axis=-1) | (fifth << 4)
    return GroupQuantized(codes.reshape(n, k), scales, mins)


def _read_q4_k(raw: np.ndarray, n: int, k: int) -> GroupQuantized:
    """Q4_K super-blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit (scale, min) x 8, 128
    bytes of nibbles where each 32 bytes hold sub-block 2c in low and 2c+1 in high nibbles."""
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, S]
    dmin = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    a, b, c = raw[..., 4:8], raw[..., 8:12], raw[..., 12:16]  # the 12 scale bytes [N, S, 4] x 3
    low = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], -1)  # sub-block scales
    high = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], -1)  # sub-block mins
    scales = d[..., None] * low.astype(np.float32)  # [N, S, 8]
    mins = -dmin[..., None] * high.astype(np.float32)
    qs = raw[..., 16:].reshape(n, -1, 4, 32)  # [N, S, chunk, 32]
    codes = np.stack([qs & 15, qs >> 4], axis=3)  # [N, S, chunk, 2, 32]: sub-block 2c, 2c+1
    return GroupQuantized(codes.reshape(n, k), scales.reshape(n, -1), mins.reshape(n, -1))


def quantize_groups(rows: np.ndarray) -> GroupQuantized:
    """float32 `[N, K]` as 4-bit codes with a scale and min per 32 weights (each group's
    range in 16 steps): what torch's int4 kernel multiplies."""
    n, k = rows.shape
    groups = rows.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    low, high = groups.min(axis=-1), groups.max(axis=-1)
    scales = np.maximum((high - low) / 15, np.float32(1e-12)).astype(np.float32)
    codes = np.rint((groups - low[..., None]) / scales[..., None]).clip(0, 15)
    return GroupQuantized(codes.astype(np.uint8).reshape(n, k), scales, low.astype(np.float32))


@dataclass
class BlockCodes:
    """Rows of `code * scale`: codes `[N, K]` int8, scales `[N, K/32]` (one a block of 32)
    or `[N, K/16]` (one a half block) float32; what runtime/kernels/int8_rows.c multiplies."""

    codes: np.ndarray
    scales: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    def dequantize(self) -> np.ndarray:
        n, k = self.codes.shape
        step = k // self.scales.shape[1]
        grouped = self.codes.reshape(n, -1, step).astype(np.float32)
        return (grouped * self.scales[..., None]).reshape(n, k)

    def take_rows(self, order: np.ndarray) -> BlockCodes:
        return BlockCodes(self.codes[order], self.scales[order])

    def scaled(self, factor: float) -> BlockCodes:
        return BlockCodes(self.codes, self.scales * np.float32(factor))

    @staticmethod
    def concat(parts: list[BlockCodes]) -> BlockCodes:
        """Parts stacked by rows, each with a scale per 16 where any part has one."""
        per_16 = max(p.scales.shape[1] * 32 // p.shape[1] for p in parts) == 2
        scales = [
            np.repeat(p.scales, 2, axis=1)
            if per_16 and p.scales.shape[1] * 32 == p.shape[1]
            else p.scales
            for p in parts
        ]
        return BlockCodes(np.concatenate([p.codes for p in parts]), np.concatenate(scales))


def read_eight_bit(blocks: np.ndarray, qtype: Q, shape: tuple[int, int]) -> BlockCodes:
    """Q8_0 (a float16 scale, then 32 int8 codes) or Q6_K (super-blocks of 256: 6-bit codes
    in low nibbles and high bit pairs, an int8 scale per 16, a float16 factor) as signed
    codes and float32 scales, exactly the file's values (Q6_K's code minus 32)."""
    n, k = shape
    if qtype == Q.Q8_0:
        raw = np.asarray(blocks, np.uint8).reshape(n, k // GROUP_SIZE, 34)
        scales = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        return BlockCodes(np.ascontiguousarray(raw[..., 2:]).view(np.int8).reshape(n, k), scales)
    if qtype == Q.Q6_K:
        return _read_q6_k(np.asarray(blocks, np.uint8).reshape(n, k // 256, 210), n, k)
    raise ValueError(f"{qtype.name} is not an 8-bit block type")


def _read_q6_k(raw: np.ndarray, n: int, k: int) -> BlockCodes:
    """Each half of 128 weights: 64 bytes of nibbles (weights l, l+32 low; l+64, l+96 high),
    32 of bit pairs (weight l + 32j's at bits 2j), as llama.cpp's dequantize_row_q6_K."""
    ql = raw[..., :128].reshape(n, -1, 2, 2, 32)  # [N, S, half, 2, 32]
    qh = raw[..., 128:192].reshape(n, -1, 2, 1, 32)
    low = np.concatenate([ql & 15, ql >> 4], axis=3)  # [N, S, half, 4, 32]: q1, q2, q3, q4
    high = np.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)
    codes = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    sub = raw[..., 192:208].copy().view(np.int8).astype(np.float32)  # [N, S, 16]
    d = raw[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)
    return BlockCodes(codes.reshape(n, k), (d[..., None] * sub).reshape(n, k // 16))
