"""runtime/kernels/int4_rows.c: the 4-bit product against an independent numpy statement of
its arithmetic, its rows' independence from their batch, and its AVX2 build giving the VNNI
build's numbers. Its accuracy on the real models is held by tests/runtime/test_golden.py
(teacher-forced top-1 against llama.cpp and float32)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.kernels import native
from runtime.kernels.cpu import cpu_features
from runtime.kernels.gguf_blocks import GroupQuantized, quantize_groups
from runtime.kernels.native import INT8_BLOCK, Int4Rows, int4_rows, pack_int4

pytestmark = pytest.mark.skipif(int4_rows() is None, reason="no C compiler for the kernel")


def _quantized_activations(x: np.ndarray) -> np.ndarray:
    """Each row rounded to int8 per block of 32 as the kernel states it (float32 scale =
    peak / 127, code = round-half-even(value * (127 / peak)) in float32), back in float64."""
    blocks = x.astype(np.float32).reshape(len(x), -1, INT8_BLOCK)
    peak = np.abs(blocks).max(axis=2, keepdims=True)
    scale = peak / np.float32(127)
    inverse = np.where(peak > 0, np.float32(127) / np.where(peak > 0, peak, 1), 0)
    codes = np.round(blocks * inverse.astype(np.float32))
    return (codes.astype(np.float64) * scale).reshape(x.shape)


def _weights(rng: np.random.Generator, n: int, k: int) -> GroupQuantized:
    return quantize_groups((rng.standard_normal((n, k)) * 0.05).astype(np.float32))


def _stored(q: GroupQuantized) -> np.ndarray:
    """The weights as the packing keeps them: scales and mins rounded to IEEE half."""
    half = lambda a: a.astype(np.float16).astype(np.float64)  # noqa: E731
    n, k = q.shape
    groups = q.codes.reshape(n, k // INT8_BLOCK, INT8_BLOCK).astype(np.float64)
    return (groups * half(q.scales)[..., None] + half(q.mins)[..., None]).reshape(n, k)


@pytest.mark.parametrize("n, k", [(13, 64), (256, 576), (1030, 640), (96, 1536)])
def test_product_is_the_blockwise_rounded_rows_times_the_weights(n, k):
    rng = np.random.default_rng(n + k)
    q = _weights(rng, n, k)
    x = rng.standard_normal((6, k)).astype(np.float32)
    x[1] *= 40.0  # a row far from unit scale
    x[2, :INT8_BLOCK] = 0.0  # an all-zero block
    input_scale = rng.uniform(0.5, 1.5, k).astype(np.float32)
    got = int4_rows()(x, pack_int4(q), n, input_scale)
    expected = _quantized_activations(x * input_scale) @ _stored(q).T
    assert got.shape == (6, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    without = int4_rows()(x, pack_int4(q), n)
    np.testing.assert_allclose(
        without, _quantized_activations(x) @ _stored(q).T, rtol=1e-5, atol=1e-4
    )


def test_a_rows_result_does_not_depend_on_its_batch():
    rng = np.random.default_rng(3)
    n, k = 203, 576  # not a multiple of the kernel's groups or tiles
    packed = pack_int4(_weights(rng, n, k))
    x = rng.standard_normal((37, k)).astype(np.float32)
    alone = np.concatenate([int4_rows()(x[i : i + 1], packed, n) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 8, 9, 32, 37):
        batched = int4_rows()(x[:rows], packed, n)
        assert np.array_equal(batched, alone[:rows]), f"rows differ in a call of {rows}"


@pytest.mark.skipif(
    "avx512_vnni" not in cpu_features().flags, reason="this CPU builds the AVX2 path anyway"
)
def test_the_avx2_build_gives_the_vnni_builds_numbers():
    """An AVX2-only machine (vpmaddubsw + vpmaddwd) computes the same exact int32 dots as
    VNNI's vpdpbusd, so a sequence gets the same logits on either kind of CPU."""
    avx2 = native._library(native.INT4_ROWS_SOURCE, ("-mno-avx512vnni", "-mno-avxvnni"))
    assert avx2 is not None
    rng = np.random.default_rng(11)
    n, k = 200, 1536
    packed = pack_int4(_weights(rng, n, k))
    x = rng.standard_normal((9, k)).astype(np.float32) * 30
    assert np.array_equal(Int4Rows(avx2)(x, packed, n), int4_rows()(x, packed, n))


def test_bad_arguments_are_refused_before_the_kernel_runs():
    kernel = int4_rows()
    packed = pack_int4(_weights(np.random.default_rng(1), 16, 64))
    with pytest.raises(ValueError, match="packed"):
        kernel(np.zeros((1, 96), np.float32), packed, 16)
    with pytest.raises(ValueError, match="packed"):
        kernel(np.zeros((1, 64), np.float32), packed, 24)
    with pytest.raises(ValueError, match="input_scale"):
        kernel(np.zeros((1, 64), np.float32), packed, 16, np.ones(64, np.float64))
