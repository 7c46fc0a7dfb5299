"""The quant types a Q4_K_M / Q5_K_M / IQ4_XS / MXFP4 file holds beyond Q4_K, Q6_K and Q8_0,
each multiplied from its own codes (runtime/kernels/gguf_blocks.py reads them, the torch
backend picks the kernel): Q5_K through lowbit_rows.c's 5-bit build as Q5_0 / Q5_1 go;
Q3_K, IQ4_NL, IQ4_XS and MXFP4 as int8 codes with a float32 scale per 16 or 32 through
int8_rows.c; Q2_K's codes the same way plus its mins against sums of the activations.
Each against float32 products of gguf's own `dequantize` of the same blocks (llama.cpp's
Python port), its rows independent of their batch, and no dense copy kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from runtime.gguf_file import GGUFFile
from runtime.kernels import TensorPart
from runtime.kernels.cpu import row_invariant_plan
from runtime.kernels.cpu_features import cpu_features
from runtime.kernels.gguf_blocks import (
    EIGHT_BIT_TYPES,
    FIVE_BIT_TYPES,
    read_eight_bit,
    read_five_bit,
    read_two_bit,
)
from runtime.kernels.native import INT8_BLOCK, int8_rows, lowbit_builds
from runtime.kernels.torch_backend import (
    WEIGHT_CLASSES,
    Int8BlockGroupWeight,
    Int8BlockWeight,
    LowBitWeight,
    NibbleGroupWeight,
    TorchBackend,
    TwoBitWeight,
    nibble_table,
)
from tests.runtime.int8_activations import blockwise_rounded
from tests.runtime.quant_blocks import random_blocks

pytestmark = pytest.mark.skipif(
    int8_rows() is None or not lowbit_builds(), reason="no C compiler for the kernels"
)

Q = gguf.GGMLQuantizationType
NEW_TYPES = [Q.Q5_K, Q.Q3_K, Q.Q2_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4]


def read(raw: np.ndarray, qtype: Q, shape: tuple[int, int]):
    if qtype in FIVE_BIT_TYPES:
        return read_five_bit(raw, qtype, shape)
    if qtype in EIGHT_BIT_TYPES:
        return read_eight_bit(raw, qtype, shape)
    return read_two_bit(raw, qtype, shape)


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda q: q.name)
def test_blocks_read_as_exactly_what_gguf_dequantizes(qtype):
    raw = random_blocks(qtype, 24, 768)
    q = read(raw, qtype, (24, 768))
    expected = gguf.quants.dequantize(raw, qtype).reshape(24, 768)
    np.testing.assert_array_equal(q.dequantize(), expected)


def _rows(k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((11, k)).astype(np.float32)
    x[1] *= 40.0  # a row far from unit scale
    x[2, :INT8_BLOCK] = 0.0  # an all-zero block
    return x


def _weight(qtype: Q, raw: np.ndarray, shape: tuple[int, int], grouped: bool, scale):
    q = read(raw, qtype, shape)
    if qtype in FIVE_BIT_TYPES:
        return LowBitWeight(q, 5, scale)
    if qtype in EIGHT_BIT_TYPES and grouped:  # 4-bit indices, the plan's grouped layout
        return NibbleGroupWeight(q, nibble_table({qtype}), scale)
    if qtype in EIGHT_BIT_TYPES:
        return Int8BlockWeight(q, scale)
    return TwoBitWeight(q, grouped, scale)


@pytest.mark.parametrize("grouped", [True, False], ids=["groups", "rows"])
@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("n, k", [(61, 256), (70, 1536)])
def test_the_product_is_the_rounded_rows_times_ggufs_values(qtype, grouped, n, k):
    """Our kernel against float32 products of gguf's dequantized blocks over the rows as the
    plan rounds them (int8 per block of 32, after an RMSNorm weight): within float32
    summation for the types that are exactly code * scale (Q5_K's sub-block scales and
    mins are held as IEEE half, as Q4_K's are: llama.cpp's own product rounds them too);
    Q2_K's codes meet the rounded rows and its mins the sums of the unrounded rows (each
    16's), themselves rounded in two int8 passes: within ~2^-14 of the mins' term."""
    if qtype in FIVE_BIT_TYPES and not grouped:
        pytest.skip("lowbit_rows.c has one layout")
    raw = random_blocks(qtype, n, k, seed=n)
    x = _rows(k, seed=k)
    input_scale = np.random.default_rng(1).uniform(0.5, 1.5, k).astype(np.float32)
    weight = _weight(qtype, raw, (n, k), grouped, input_scale)
    dense = gguf.quants.dequantize(raw, qtype).reshape(n, k).astype(np.float64)
    rounded = blockwise_rounded(x * input_scale)
    expected = rounded @ dense.T
    got = weight(x)
    assert got.shape == (11, n) and got.dtype == np.float32
    if qtype == Q.Q5_K:  # half scales: ~2^-11 of each term, as for Q4_K (test_lowbit_rows)
        tolerance = 2e-3 * (np.abs(rounded) @ np.abs(dense).T)
    elif qtype == Q.Q2_K:  # the codes meet the rounded rows, the mins the rows' own sums
        q = read_two_bit(raw, qtype, (n, k))
        mins = np.repeat(q.mins, 16, axis=1).astype(np.float64)
        sums = (x * input_scale).astype(np.float64) @ mins.T
        expected = rounded @ (dense - mins).T + sums
        # the sums rounded in two int8 passes: ~2^-14 of each 32 sums' largest
        tolerance = 1e-5 * np.abs(expected).max() + 1e-4 * np.abs(sums).max()
    else:
        tolerance = 1e-5 * np.abs(expected).max()
    assert (np.abs(got - expected) <= tolerance).all(), np.abs(got - expected).max()
    # and near the float product of the unrounded rows: int8 rounding is all that differs
    exact = (x * input_scale).astype(np.float64) @ dense.T
    relative = np.abs(got - exact).max() / np.abs(exact).max()
    assert relative < 0.02, relative


@pytest.mark.parametrize("grouped", [True, False], ids=["groups", "rows"])
@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda q: q.name)
def test_a_rows_result_does_not_depend_on_its_batch(qtype, grouped):
    raw = random_blocks(qtype, 45, 512, seed=3)  # rows not a multiple of any tile
    weight = _weight(qtype, raw, (45, 512), grouped, None)
    x = np.random.default_rng(4).standard_normal((33, 512)).astype(np.float32)
    alone = np.concatenate([weight(x[i : i + 1]) for i in range(len(x))])
    for rows in (2, 3, 5, 8, 9, 32, 33):
        assert np.array_equal(weight(x[:rows]), alone[:rows]), f"rows differ in {rows}"


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda q: q.name)
def test_the_backend_keeps_each_type_as_its_codes(qtype, tmp_path):
    """What a model load does: the plan's backend reads the file's tensor, fused with a
    row order and a scale as a model's q/k are, into its own kernel and no float copy;
    the product equals the same kernel over the same codes, and it holds about the file's
    bytes (at most an int8 code and its scales a weight, where fp16 took 2 bytes)."""
    f = _file(tmp_path, qtype)
    backend = TorchBackend(row_invariant_plan(cpu_features()))
    order = np.arange(48)[::-1].copy()
    weight = backend.linear(f, [TensorPart("w0", row_order=order, scale=0.5)])
    grouped = backend.plan.eight_bit == Int8BlockGroupWeight.kind
    group = NibbleGroupWeight if grouped else Int8BlockWeight
    expected_class = {Q.Q5_K: LowBitWeight, Q.Q2_K: TwoBitWeight}.get(qtype, group)
    assert type(weight) is expected_class
    x = np.random.default_rng(5).standard_normal((3, 512)).astype(np.float32)
    dense = f.tensor("w0")[order] * np.float32(0.5)
    exact = x.astype(np.float64) @ dense.T.astype(np.float64)
    assert np.abs(weight(x) - exact).max() < 0.02 * np.abs(exact).max()
    n = 48 * 512
    assert weight.nbytes == backend.stored_bytes(f, "w0", "linear")
    # fp16 held 2 bytes a weight; 4-bit indices (and Q2_K's mins) and float32 scales
    assert weight.nbytes < (0.85 if grouped else 1.35) * n


def _file(tmp_path, qtype: Q) -> GGUFFile:
    path = tmp_path / f"{qtype.name}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w0", random_blocks(qtype, 48, 512, seed=7), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFFile(path)


AVX2_SCRIPT = """
import sys
import numpy as np
from tests.runtime.test_quant_types import NEW_TYPES, Q, _weight, random_blocks
x = np.load(sys.argv[1])
out = {}
for qtype in NEW_TYPES:
    raw = random_blocks(qtype, 40, 768, seed=9)
    out[qtype.name] = _weight(qtype, raw, (40, 768), True, None)(x)
np.savez(sys.argv[2], **out)
"""


@pytest.mark.parametrize("qtype", [Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4], ids=lambda q: q.name)
def test_4_bit_indices_give_the_8_bit_layouts_numbers(qtype):
    """The nibble builds (a shuffle through the type's value table) multiply exactly as the
    8-bit grouped layout does over the same codes, at half its bytes."""
    raw = random_blocks(qtype, 45, 768, seed=2)
    q = read(raw, qtype, (45, 768))
    x = _rows(768, seed=6)
    wide, narrow = Int8BlockGroupWeight(q, None), NibbleGroupWeight(q, nibble_table({qtype}), None)
    assert np.array_equal(narrow(x), wide(x))
    assert narrow.packed.nbytes * 2 == wide.packed.nbytes


@pytest.mark.skipif(
    "avx512f" not in cpu_features().flags, reason="this CPU builds the AVX2 path anyway"
)
def test_the_avx2_build_gives_the_avx512_builds_numbers(tmp_path):
    """A process that answers as an AVX2-only CPU (`LLMQ_CPU_LEVEL=avx2`: kernels built
    without AVX-512 or VNNI) gets the same products bitwise: vpmaddubsw's exact int32s and
    the same float32 operations per row, so a sequence's logits match across CPU kinds."""
    x = np.random.default_rng(8).standard_normal((5, 768)).astype(np.float32) * 20
    np.save(tmp_path / "x.npy", x)
    env = {**os.environ, "LLMQ_CPU_LEVEL": "avx2"}
    command = [sys.executable, "-c", AVX2_SCRIPT, str(tmp_path / "x.npy"), str(tmp_path / "o")]
    subprocess.run(command, env=env, check=True, timeout=600, cwd=Path(__file__).parents[2])
    avx2 = np.load(tmp_path / "o.npz")
    for qtype in NEW_TYPES:
        raw = random_blocks(qtype, 40, 768, seed=9)
        expected = _weight(qtype, raw, (40, 768), True, None)(x)
        assert np.array_equal(avx2[qtype.name], expected), qtype.name


@pytest.mark.parametrize("qtype", [Q.IQ4_XS, Q.MXFP4, Q.Q3_K, Q.Q2_K], ids=lambda q: q.name)
def test_a_head_of_the_type_takes_the_files_product(qtype, tmp_path):
    """A head in one of these types, as the file's own product (the AVX2 plan's head, and
    every plan's `full` head): its query rows rounded in two int8 passes, so within ~2^-14
    of the float product of gguf's values."""
    f = _file(tmp_path, qtype)
    backend = TorchBackend(row_invariant_plan(cpu_features()))
    head = backend._file_head(f, "w0")
    x = np.random.default_rng(6).standard_normal((3, 512)).astype(np.float32)
    exact = x.astype(np.float64) @ f.tensor("w0").T.astype(np.float64)
    assert np.abs(head(x) - exact).max() < 1e-3 * np.abs(exact).max()
    again = WEIGHT_CLASSES[head.kind].restored(head.shape, head.saved())  # a prepared load's
    assert np.array_equal(again(x), head(x))
