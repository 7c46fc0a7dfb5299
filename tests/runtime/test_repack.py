"""runtime/kernels/repack.c against the numpy readers and packers it stands in for at load:
the same bytes, bitwise, for Q4_K (lowbit_rows.c's layout), Q8_0 / Q6_K (int8_rows.c's
grouped layout) and a Q8_0 / Q6_K head requantized to int8 per row, over random blocks whose
float16 factors span subnormals to large values, with row orders, a part's scale, fused
parts and rows that leave a group part empty."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from runtime.kernels import TensorPart, repack
from runtime.kernels.gguf_blocks import BlockCodes, GroupQuantized, quantize_groups
from runtime.kernels.native import pack_int8_groups, pack_int8_rows, pack_lowbit
from runtime.kernels.torch_backend import Int8Weight, block_part, group_part
from tests.runtime.quant_blocks import FLOAT16_FIELDS

Q = gguf.GGMLQuantizationType
K = 512
FIELDS = {**FLOAT16_FIELDS, Q.Q8_0: (0, 1)}  # where each type keeps its float16 factors

pytestmark = pytest.mark.skipif(repack._lib() is None, reason="no C compiler here")


class Blocks:
    """The part of GGUFFile the packers read: each tensor's raw rows, type and shape."""

    def __init__(self, tensors: dict[str, tuple[np.ndarray, Q]]) -> None:
        self.tensors = tensors

    def blocks(self, name: str) -> tuple[np.ndarray, Q, tuple[int, int]]:
        raw, qtype = self.tensors[name]
        return raw, qtype, (len(raw), K)


def wide_blocks(qtype: Q, rows: int, seed: int) -> np.ndarray:
    """Random blocks whose float16 factors are 0.001..0.01 in two thirds of the blocks and
    any finite half (subnormals, large ones) in the rest, so that the halves the packers
    round to are tested at every scale."""
    rng = np.random.default_rng(seed)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, K // block_size, block_bytes), dtype=np.uint8)
    offset, count = FIELDS[qtype]
    small = rng.uniform(0.001, 0.01, blocks.shape[:2] + (count,)).astype(np.float16)
    bits = rng.integers(0, 0x7C00, small.shape, dtype=np.uint16)
    bits |= rng.integers(0, 2, bits.shape, dtype=np.uint16) << 15  # either sign
    wide = rng.random(blocks.shape[:2]) < 1 / 3
    small.view(np.uint16)[wide] = bits[wide]
    blocks[..., offset : offset + 2 * count] = small.view(np.uint8)
    return blocks.reshape(rows, -1)


def parts_of(rows: int) -> list[list[TensorPart]]:
    order = np.random.default_rng(1).permutation(rows)
    return [
        [TensorPart("a")],
        [TensorPart("a", row_order=order, scale=0.37)],
        [TensorPart("a"), TensorPart("b", scale=1.7), TensorPart("a", row_order=order)],
    ]


@pytest.mark.parametrize("rows", [16, 40])
def test_q4_k_lowbit_is_pack_lowbit(rows: int) -> None:
    f = Blocks(
        {"a": (wide_blocks(Q.Q4_K, rows, 0), Q.Q4_K), "b": (wide_blocks(Q.Q4_K, 8, 2), Q.Q4_K)}
    )
    for parts in parts_of(rows):
        with np.errstate(over="ignore"):  # a large scale times a part's is inf, both ways
            want = pack_lowbit(GroupQuantized.concat([group_part(f, p) for p in parts]), 4)
        np.testing.assert_array_equal(repack.q4k_lowbit(f, parts), want)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K])
@pytest.mark.parametrize("rows", [16, 40])
def test_int8_groups_is_pack_int8_groups(qtype: Q, rows: int) -> None:
    f = Blocks(
        {"a": (wide_blocks(qtype, rows, 0), qtype), "b": (wide_blocks(Q.Q8_0, 8, 2), Q.Q8_0)}
    )
    for parts in parts_of(rows):
        with np.errstate(over="ignore"):
            codes = BlockCodes.concat([block_part(f, p) for p in parts])
        want = pack_int8_groups(codes.codes, np.asarray(codes.scales, np.float32))
        packed, scales = repack.int8_groups(f, parts)
        np.testing.assert_array_equal(packed, want[0])
        np.testing.assert_array_equal(scales.view(np.uint32), want[1].view(np.uint32))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q6_K])
@pytest.mark.parametrize("rows", [16, 40])
def test_heads_are_their_numpy_builds(qtype: Q, rows: int) -> None:
    """The int8 head (Int8Weight.quantized, pack_int8_rows) and the large head's ranking
    (quantize_groups, pack_lowbit) from gguf's dequantized rows."""
    raw = wide_blocks(qtype, rows, 3)
    raw[0] = 0  # a row of zeros: the smallest scales
    f = Blocks({"head": (raw, qtype)})
    with np.errstate(over="ignore", invalid="ignore"):
        dense = np.ascontiguousarray(gguf.quants.dequantize(raw, qtype).reshape(rows, K))
        finite = np.isfinite(dense).all(axis=1) & (np.abs(dense).max(axis=1) < 1e30)
    raw, dense = raw[finite], dense[finite]  # rows whose requantization is defined
    f = Blocks({"head": (raw, qtype)})
    codes, scales = Int8Weight.quantized(torch.from_numpy(dense))
    want = pack_int8_rows(codes.numpy(), scales.float().numpy())
    np.testing.assert_array_equal(repack.int8_head(f, "head"), want)
    with np.errstate(over="ignore"):  # a group's range past the largest half: inf both ways
        ranking = pack_lowbit(quantize_groups(dense), 4)
    np.testing.assert_array_equal(repack.ranking(f, "head"), ranking)


def test_other_types_keep_their_path() -> None:
    f = Blocks(
        {"a": (wide_blocks(Q.Q4_1, 16, 0), Q.Q4_1), "b": (wide_blocks(Q.Q4_K, 16, 0), Q.Q4_K)}
    )
    assert repack.q4k_lowbit(f, [TensorPart("a")]) is None
    assert repack.q4k_lowbit(f, [TensorPart("b"), TensorPart("a")]) is None
    assert repack.int8_groups(f, [TensorPart("b")]) is None
    assert repack.int8_head(f, "a") is None
    assert repack.ranking(f, "b") is None
