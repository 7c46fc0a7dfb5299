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
# Q5_K: 5-bit codes with a 6-bit scale and min per 32, as Q4_K's (`_read_q5_k`)
FIVE_BIT_TYPES = frozenset({Q.Q5_0, Q.Q5_1, Q.Q5_K})
# read as signed 8-bit codes with a float32 scale per 32 (Q8_0; IQ4_NL, IQ4_XS and MXFP4,
# whose 4-bit codes index an int8 table) or per 16 (Q6_K, Q3_K) weights: every value is
# exactly code * scale in float32 (`read_eight_bit`)
EIGHT_BIT_TYPES = frozenset({Q.Q8_0, Q.Q6_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4})
# a scale per 16 weights, where the others have one per 32
PER_16_TYPES = frozenset({Q.Q6_K, Q.Q3_K})
# Q2_K: 2-bit codes with a 4-bit scale and min per 16 (`read_two_bit`): the codes times
# their scales as the 8-bit types are multiplied, plus each sub-block's min times the sum
# of its activations
TWO_BIT_TYPES = frozenset({Q.Q2_K})


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
    if qtype == Q.Q5_K:
        return _read_q5_k(np.asarray(blocks, np.uint8).reshape(n, k // 256, 176), n, k)
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


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's f16 d, f16 dmin and 12 bytes of 6-bit (scale, min) x 8 as float32
    scales and mins `[N, S, 8]` (llama.cpp's get_scale_min_k4)."""
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, S]
    dmin = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    a, b, c = raw[..., 4:8], raw[..., 8:12], raw[..., 12:16]  # the 12 scale bytes [N, S, 4] x 3
    low = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], -1)  # sub-block scales
    high = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], -1)  # sub-block mins
    return d[..., None] * low.astype(np.float32), -dmin[..., None] * high.astype(np.float32)


def _read_q4_k(raw: np.ndarray, n: int, k: int) -> GroupQuantized:
    """Q4_K super-blocks of 256: `_k_scales`' 16 bytes, then 128 bytes of nibbles where each
    32 bytes hold sub-block 2c in low and 2c+1 in high nibbles."""
    scales, mins = _k_scales(raw)
    qs = raw[..., 16:].reshape(n, -1, 4, 32)  # [N, S, chunk, 32]
    codes = np.stack([qs & 15, qs >> 4], axis=3)  # [N, S, chunk, 2, 32]: sub-block 2c, 2c+1
    return GroupQuantized(codes.reshape(n, k), scales.reshape(n, -1), mins.reshape(n, -1))


def _read_q5_k(raw: np.ndarray, n: int, k: int) -> GroupQuantized:
    """Q5_K super-blocks of 256: Q4_K's 16 bytes of factors and scales, 32 bytes of fifth
    bits (bit s of byte l: sub-block s's weight l), then Q4_K's 128 bytes of nibbles."""
    scales, mins = _k_scales(raw)
    qh = raw[..., 16:48][:, :, None, :]  # [N, S, 1, 32]
    fifth = (qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [N, S, sub-block, 32]
    qs = raw[..., 48:].reshape(n, -1, 4, 32)
    low = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, -1, 8, 32)
    codes = low | (fifth << 4)
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
    if qtype == Q.Q3_K:
        return _read_q3_k(np.asarray(blocks, np.uint8).reshape(n, k // 256, 110), n, k)
    if qtype == Q.IQ4_NL:
        raw = np.asarray(blocks, np.uint8).reshape(n, k // GROUP_SIZE, 18)
        scales = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        return BlockCodes(_table_codes(raw[..., 2:], IQ4_VALUES).reshape(n, k), scales)
    if qtype == Q.IQ4_XS:
        return _read_iq4_xs(np.asarray(blocks, np.uint8).reshape(n, k // 256, 136), n, k)
    if qtype == Q.MXFP4:
        raw = np.asarray(blocks, np.uint8).reshape(n, k // GROUP_SIZE, 17)
        scales = gguf.quants.MXFP4.e8m0_to_fp32_half(raw[..., 0]).astype(np.float32)
        return BlockCodes(_table_codes(raw[..., 1:], MXFP4_VALUES).reshape(n, k), scales)
    raise ValueError(f"{qtype.name} is not an 8-bit block type")


# the int8 values 4-bit codes index: llama.cpp's kvalues_iq4nl and kvalues_mxfp4 (e2m1
# doubled; the block's scale is halved to match, as ggml_e8m0_to_fp32_half)
IQ4_VALUES = np.array(gguf.quants.IQ4_NL.kvalues, np.int8)
MXFP4_VALUES = np.array(gguf.quants.MXFP4.kvalues, np.int8)


def _table_codes(nibbles: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Blocks of 16 bytes (weight j in the low nibble of byte j, weight j + 16 in the high)
    as the table's int8 values `[..., 32]`."""
    return table[np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)]


def _read_iq4_xs(raw: np.ndarray, n: int, k: int) -> BlockCodes:
    """IQ4_XS super-blocks of 256: f16 d, a uint16 of high scale bit pairs, 4 bytes of low
    scale nibbles, then 8 blocks of 16 bytes as IQ4_NL's; sub-block s's scale is
    d * (6-bit scale - 32)."""
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, S]
    high = raw[..., 2:4].copy().view(np.uint16)  # [N, S, 1]
    low = raw[..., 4:8]
    low = np.stack([low & 15, low >> 4], axis=-1).reshape(n, -1, 8)
    high = ((high >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.uint8)
    sub = (low | (high << 4)).astype(np.float32) - 32
    codes = _table_codes(raw[..., 8:].reshape(n, -1, 8, 16), IQ4_VALUES)
    return BlockCodes(codes.reshape(n, k), (d[..., None] * sub).reshape(n, k // GROUP_SIZE))


def _read_q3_k(raw: np.ndarray, n: int, k: int) -> BlockCodes:
    """Q3_K super-blocks of 256: 32 bytes of high bits (bit j of byte l: weight 32j + l's),
    64 bytes of bit pairs (each 32 bytes hold 4 runs of 32 weights at bits 0, 2, 4, 6), 12
    bytes of 6-bit scales (one per 16 weights), f16 d. A weight is d * (scale - 32) times
    its 2-bit code, minus 4 where its high bit is clear (gguf's Q3_K.dequantize_blocks)."""
    hmask = raw[..., :32][:, :, None, :]  # [N, S, 1, 32]
    qs = raw[..., 32:96].reshape(n, -1, 2, 1, 32)
    packed = raw[..., 96:108]
    d = raw[..., 108:110].copy().view(np.float16)[..., 0].astype(np.float32)
    shifts = np.array([0, 2, 4, 6], np.uint8)[:, None]
    low = ((qs >> shifts) & 3).reshape(n, -1, 8, 32)  # [N, S, run, 32]
    high = ((hmask >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(n, -1, 8, 32)
    codes = low.astype(np.int8) - ((high ^ 1) << 2).astype(np.int8)
    lows = np.stack([packed[..., :8] & 15, packed[..., :8] >> 4], axis=-2).reshape(n, -1, 16)
    highs = (packed[..., 8:12][:, :, None, :] >> shifts) & 3  # [N, S, 4, 4]
    sub = (lows | (highs.reshape(n, -1, 16) << 4)).astype(np.float32) - 32
    return BlockCodes(codes.reshape(n, k), (d[..., None] * sub).reshape(n, k // 16))


@dataclass
class TwoBitCodes:
    """Q2_K rows: `codes * scales + mins` per 16 weights, as `BlockCodes` (codes 0..3 with
    `scales` `[N, K/16]`) plus `mins` `[N, K/16]` float32: each -dmin times a 4-bit code
    (`min_codes` `[N, K/16]` int8, `dmin` `[N, K/256]` float32)."""

    codes: BlockCodes
    min_codes: np.ndarray
    dmin: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape

    @property
    def mins(self) -> np.ndarray:
        return np.repeat(self.dmin, 16, axis=1) * -self.min_codes.astype(np.float32)

    def dequantize(self) -> np.ndarray:
        return self.codes.dequantize() + np.repeat(self.mins, 16, axis=1)

    def take_rows(self, order: np.ndarray) -> TwoBitCodes:
        return TwoBitCodes(self.codes.take_rows(order), self.min_codes[order], self.dmin[order])

    def scaled(self, factor: float) -> TwoBitCodes:
        f = np.float32(factor)
        return TwoBitCodes(self.codes.scaled(factor), self.min_codes, self.dmin * f)

    @staticmethod
    def concat(parts: list[TwoBitCodes]) -> TwoBitCodes:
        return TwoBitCodes(
            BlockCodes.concat([p.codes for p in parts]),
            np.concatenate([p.min_codes for p in parts]),
            np.concatenate([p.dmin for p in parts]),
        )


def read_two_bit(blocks: np.ndarray, qtype: Q, shape: tuple[int, int]) -> TwoBitCodes:
    """Q2_K super-blocks of 256: 16 bytes of (scale low nibble, min high nibble) per 16
    weights, 64 bytes of bit pairs (as Q3_K's), f16 d, f16 dmin. A weight is
    d * scale * code - dmin * min (gguf's Q2_K.dequantize_blocks)."""
    if qtype not in TWO_BIT_TYPES:
        raise ValueError(f"{qtype.name} is not a 2-bit block type")
    n, k = shape
    raw = np.asarray(blocks, np.uint8).reshape(n, k // 256, 84)
    packed, qs = raw[..., :16], raw[..., 16:80].reshape(n, -1, 2, 1, 32)
    d = raw[..., 80:82].copy().view(np.float16)[..., 0].astype(np.float32)
    dmin = raw[..., 82:84].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = ((qs >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3).astype(np.int8)
    scales = (d[..., None] * (packed & 15).astype(np.float32)).reshape(n, k // 16)
    min_codes = (packed >> 4).astype(np.int8).reshape(n, k // 16)
    return TwoBitCodes(BlockCodes(codes.reshape(n, k), scales), min_codes, dmin)


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
