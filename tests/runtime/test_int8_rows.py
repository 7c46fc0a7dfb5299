"""runtime/kernels/int8_rows.c: the int8-weight product (per row, and over a file's own Q8_0
and Q6_K codes) against an independent numpy statement of its arithmetic, its rows'
independence from their batch, its AVX2 build's numbers, and the fallback to torch's
kernel where it cannot take a weight. Its accuracy on the real heads is held by
tests/runtime/test_golden.py (teacher-forced top-1 against llama.cpp and float32)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from runtime.kernels import native
from runtime.kernels.cpu_features import cpu_features
from runtime.kernels.gguf_blocks import read_eight_bit
from runtime.kernels.native import INT8_BLOCK, int8_rows
from runtime.kernels.torch_backend import (
    Int8BlockGroupHead,
    Int8BlockGroupWeight,
    Int8BlockHead,
    Int8BlockWeight,
    Int8Weight,
)
from tests.runtime.int8_activations import blockwise_rounded

pytestmark = pytest.mark.skipif(int8_rows() is None, reason="no C compiler for the kernel")


def _weight(rng: np.random.Generator, n: int, k: int) -> Int8Weight:
    return Int8Weight.from_dense(rng.standard_normal((n, k)).astype(np.float32))


@pytest.mark.parametrize("n, k", [(61, 64), (256, 576), (1024, 640)])
def test_product_is_the_blockwise_rounded_rows_times_the_weights(n, k):
    rng = np.random.default_rng(n + k)
    weight = _weight(rng, n, k)
    x = rng.standard_normal((5, k)).astype(np.float32)
    x[1] *= 40.0  # a row far from unit scale
    x[2, :INT8_BLOCK] = 0.0  # an all-zero block
    dense = weight.codes.numpy().astype(np.float64) * weight.scales.float().numpy()[:, None]
    expected = blockwise_rounded(x) @ dense.T
    got = weight(x)
    assert got.shape == (5, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_a_rows_result_does_not_depend_on_its_batch():
    rng = np.random.default_rng(3)
    weight = _weight(rng, 203, 576)  # not a multiple of the kernel's tiles
    x = rng.standard_normal((33, 576)).astype(np.float32)
    alone = np.concatenate([weight(x[i : i + 1]) for i in range(len(x))])
    for rows in (2, 3, 5, 8, 32, 33):
        batched = weight(x[:rows])
        assert np.array_equal(batched, alone[:rows]), f"rows differ in a call of {rows}"


def test_a_width_it_cannot_block_keeps_torchs_kernel():
    rng = np.random.default_rng(5)
    weight = _weight(rng, 16, 48)  # 48 is not a multiple of 32
    x = rng.standard_normal((2, 48)).astype(np.float32)
    expected = torch.ops.aten._weight_int8pack_mm(
        torch.from_numpy(x).to(torch.bfloat16), weight.codes, weight.scales
    ).float()
    assert np.array_equal(weight(x), expected.numpy())


def test_bad_arguments_are_refused_before_the_kernel_runs():
    kernel = int8_rows()
    codes = np.zeros((4, 64), np.int8)
    scales = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        kernel(np.zeros((1, 48), np.float32), np.zeros((4, 48), np.int8), scales)
    with pytest.raises(ValueError, match="codes"):
        kernel(np.zeros((1, 64), np.float32), codes[:, :32], scales)
    with pytest.raises(ValueError, match="scales"):
        kernel(np.zeros((1, 64), np.float32), codes, scales.astype(np.float64))


def _q6_k_file(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Random Q6_K blocks: codes and sub-block scales at random, a small float16 factor."""
    raw = rng.integers(0, 256, (n * k // 256, 210), dtype=np.uint8)
    raw[:, -2:] = np.array([2e-3], np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def _file_blocks(rng: np.random.Generator, qtype, n: int, k: int) -> np.ndarray:
    if qtype == gguf.GGMLQuantizationType.Q6_K:
        return _q6_k_file(rng, n, k)
    return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)


EIGHT_BIT = [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q6_K]
# a row at a time (`llmq_int8_blocks`) and 16 rows side by side (`llmq_int8_groups`)
LAYOUTS = [Int8BlockWeight, Int8BlockGroupWeight]


@pytest.mark.parametrize("qtype", EIGHT_BIT, ids=lambda q: q.name)
def test_a_files_8_bit_codes_read_back_as_ggufs_dequantize(qtype):
    rng = np.random.default_rng(1)
    raw = _file_blocks(rng, qtype, 40, 512)
    q = read_eight_bit(raw, qtype, (40, 512))
    assert q.codes.dtype == np.int8
    assert np.array_equal(q.dequantize(), gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: c.kind)
@pytest.mark.parametrize("qtype", EIGHT_BIT, ids=lambda q: q.name)
@pytest.mark.parametrize("n, k", [(61, 256), (256, 768), (70, 1536)])
def test_the_files_codes_times_the_blockwise_rounded_rows(layout, qtype, n, k):
    """int8_rows.c over a file's codes, in either layout: the rounded rows times the file's
    own values, with an RMSNorm weight applied to the rows before they are rounded."""
    rng = np.random.default_rng(n + k)
    q = read_eight_bit(_file_blocks(rng, qtype, n, k), qtype, (n, k))
    x = rng.standard_normal((11, k)).astype(np.float32)
    x[1] *= 40.0
    x[2, :INT8_BLOCK] = 0.0
    input_scale = rng.uniform(0.5, 1.5, k).astype(np.float32)
    weight = layout(q, input_scale)
    expected = blockwise_rounded(x * input_scale) @ q.dequantize().astype(np.float64).T
    got = weight(x)
    assert got.shape == (11, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    alone = np.concatenate([weight(x[i : i + 1]) for i in range(len(x))])
    assert np.array_equal(got, alone)
    for rows in (2, 3, 5, 9):  # past the grouped kernel's tile of 4 rows
        assert np.array_equal(weight(x[:rows]), alone[:rows])


@pytest.mark.skipif(
    "avx512_vnni" not in cpu_features().flags, reason="this CPU builds the AVX2 path anyway"
)
@pytest.mark.parametrize("qtype", EIGHT_BIT, ids=lambda q: q.name)
def test_the_avx2_build_gives_the_vnni_builds_numbers(qtype):
    """vpmaddubsw + vpmaddwd on sign-adjusted codes (llama.cpp's AVX2 dot) and VNNI's
    vpdpbusd make the same exact int32s: a sequence gets the same logits on either CPU."""
    avx2 = native._library(native.INT8_ROWS_SOURCE, ("-mno-avx512f", "-mno-avxvnni"))
    assert avx2 is not None
    rng = np.random.default_rng(4)
    n, k = 90, 1536
    q = read_eight_bit(_file_blocks(rng, qtype, n, k), qtype, (n, k))
    x = rng.standard_normal((9, k)).astype(np.float32) * 30
    codes, scales = np.ascontiguousarray(q.codes), np.ascontiguousarray(q.scales)
    expected = int8_rows().blocks(x, codes, scales)
    assert np.array_equal(native.Int8Rows(avx2).blocks(x, codes, scales), expected)


@pytest.mark.skipif(
    "avx512_vnni" not in cpu_features().flags, reason="this CPU builds the AVX2 path anyway"
)
@pytest.mark.parametrize("fine", [False, True], ids=["one pass", "two passes"])
@pytest.mark.parametrize("qtype", EIGHT_BIT, ids=lambda q: q.name)
def test_the_grouped_avx2_build_gives_the_512_bit_builds_numbers(qtype, fine):
    """The grouped layout: AVX-512's vpdpbusd on codes plus 128 (16 rows a vector) and
    llama.cpp's AVX2 sign trick (two vectors of 8) make the same exact int32s and the same
    float32 operations per row: a sequence gets the same logits on either CPU."""
    avx2 = native._library(native.INT8_ROWS_SOURCE, ("-mno-avx512f", "-mno-avxvnni"))
    assert avx2 is not None
    rng = np.random.default_rng(6)
    n, k = 90, 1536  # not a multiple of 16 rows
    q = read_eight_bit(_file_blocks(rng, qtype, n, k), qtype, (n, k))
    x = rng.standard_normal((9, k)).astype(np.float32) * 30
    packed, scales = native.pack_int8_groups(q.codes, q.scales)
    expected = int8_rows().bind_groups(packed, scales, n, None)(x, fine)
    got = native.Int8Rows(avx2).bind_groups(packed, scales, n, None)(x, fine)
    assert np.array_equal(got, expected)


def test_the_grouped_layout_refuses_a_weight_it_does_not_hold():
    packed, scales = native.pack_int8_groups(
        np.zeros((20, 64), np.int8), np.ones((20, 2), np.float32)
    )
    assert packed.shape == (2, 2, 512) and scales.shape == (2, 2, 1, 16)
    with pytest.raises(ValueError, match="groups of 16 rows"):
        int8_rows().bind_groups(packed, scales, 40, None)
    with pytest.raises(ValueError, match="scales must be"):
        int8_rows().bind_groups(packed, scales[:, :1], 20, None)
    with pytest.raises(ValueError, match="64 columns"):
        int8_rows().bind_groups(packed, scales, 20, None)(np.zeros((1, 32), np.float32))


def test_bad_block_scales_are_refused():
    kernel = int8_rows()
    codes = np.zeros((4, 64), np.int8)
    with pytest.raises(ValueError, match="scales must be"):
        kernel.blocks(np.zeros((1, 64), np.float32), codes, np.ones((4, 3), np.float32))
    with pytest.raises(ValueError, match="scales must be"):
        kernel.blocks(np.zeros((1, 64), np.float32), codes, np.ones((4, 2), np.float64))


@pytest.mark.parametrize(
    "one_pass, two_passes",
    [(Int8BlockWeight, Int8BlockHead), (Int8BlockGroupWeight, Int8BlockGroupHead)],
    ids=["rows", "groups"],
)
def test_a_head_rounds_its_rows_in_two_passes_closer_to_exact(one_pass, two_passes):
    """`Int8BlockHead` (`Int8BlockGroupHead`): what one int8 pass misses of each block is
    rounded again, so the logits come ~100x closer to the file's values times the float32
    rows, each row still the same alone and in a batch."""
    rng = np.random.default_rng(9)
    n, k = 300, 576
    raw = _file_blocks(rng, gguf.GGMLQuantizationType.Q8_0, n, k)
    q = read_eight_bit(raw, gguf.GGMLQuantizationType.Q8_0, (n, k))
    x = rng.standard_normal((12, k)).astype(np.float32)
    exact = x.astype(np.float64) @ q.dequantize().astype(np.float64).T
    one, two = one_pass(q, None)(x), two_passes(q, None)(x)
    assert np.abs(two - exact).max() < np.abs(one - exact).max() / 50
    np.testing.assert_allclose(two, exact, rtol=1e-4, atol=1e-4 * np.abs(exact).max())
    head = two_passes(q, None)
    assert np.array_equal(np.concatenate([head(x[i : i + 1]) for i in range(len(x))]), two)


@pytest.mark.parametrize("layout", ["int8-block-groups", "int8-blocks"])
@pytest.mark.parametrize("qtype", EIGHT_BIT, ids=lambda q: q.name)
def test_a_weights_stored_bytes_are_what_its_layout_keeps(tmp_path, layout, qtype):
    """`stored_bytes` (what a load will hold) for the file's codes in either layout, the
    grouped one padding 40 rows to 48."""
    from dataclasses import replace

    from runtime.gguf_file import GGUFFile
    from runtime.kernels.base import TensorPart
    from runtime.kernels.cpu import default_plan
    from runtime.kernels.torch_backend import TorchBackend

    rng = np.random.default_rng(11)
    path = tmp_path / "w.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    raw = _file_blocks(rng, qtype, 40, 512)
    writer.add_tensor("w", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile(path)
    backend = TorchBackend(replace(default_plan(), eight_bit=layout))
    weight = backend.linear(f, [TensorPart("w")])
    assert weight.kind == layout
    assert backend.stored_bytes(f, "w", "linear") == weight.nbytes
    x = rng.standard_normal((3, 512)).astype(np.float32)
    exact = x.astype(np.float64) @ f.tensor("w").astype(np.float64).T
    np.testing.assert_allclose(weight(x), exact, rtol=0.02, atol=0.02 * np.abs(exact).max())
