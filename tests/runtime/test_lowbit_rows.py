"""runtime/kernels/lowbit_rows.c: the 4- and 5-bit products against an independent numpy
statement of their arithmetic, their rows' independence from their batch, and their AVX2
builds giving the VNNI builds' numbers. Their accuracy on the real models is held by
tests/runtime/test_golden.py (teacher-forced top-1 against llama.cpp and float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.kernels import native
from runtime.kernels.cpu import cpu_features
from runtime.kernels.gguf_blocks import GroupQuantized, quantize_groups
from runtime.kernels.native import INT8_BLOCK, LowBitRows, lowbit_rows, pack_lowbit
from runtime.kernels.torch_backend import Int8GroupWeight, Int8Weight
from tests.runtime.int8_activations import blockwise_rounded

pytestmark = pytest.mark.skipif(lowbit_rows() is None, reason="no C compiler for the kernel")
BITS = [4, 5]


def _weights(rng: np.random.Generator, n: int, k: int, bits: int) -> GroupQuantized:
    """4-bit groups; for 5 bits, the same with random fifth bits on their codes."""
    q = quantize_groups((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
    if bits == 5:
        q.codes = q.codes | (rng.integers(0, 2, q.codes.shape, dtype=np.uint8) << 4)
    return q


def _stored(q: GroupQuantized) -> np.ndarray:
    """The weights as the packing keeps them: scales and mins rounded to IEEE half."""
    half = lambda a: a.astype(np.float16).astype(np.float64)  # noqa: E731
    n, k = q.shape
    groups = q.codes.reshape(n, k // INT8_BLOCK, INT8_BLOCK).astype(np.float64)
    return (groups * half(q.scales)[..., None] + half(q.mins)[..., None]).reshape(n, k)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n, k", [(13, 64), (256, 576), (1030, 640), (96, 1536)])
def test_product_is_the_blockwise_rounded_rows_times_the_weights(n, k, bits):
    rng = np.random.default_rng(n + k)
    q = _weights(rng, n, k, bits)
    x = rng.standard_normal((6, k)).astype(np.float32)
    x[1] *= 40.0  # a row far from unit scale
    x[2, :INT8_BLOCK] = 0.0  # an all-zero block
    input_scale = rng.uniform(0.5, 1.5, k).astype(np.float32)
    kernel, packed = lowbit_rows(bits), pack_lowbit(q, bits)
    got = kernel(x, packed, n, input_scale)
    expected = blockwise_rounded(x * input_scale) @ _stored(q).T
    assert got.shape == (6, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    without = kernel(x, packed, n)
    np.testing.assert_allclose(without, blockwise_rounded(x) @ _stored(q).T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bits", BITS)
def test_a_rows_result_does_not_depend_on_its_batch(bits):
    rng = np.random.default_rng(3)
    n, k = 203, 576  # not a multiple of the kernel's groups or tiles
    kernel, packed = lowbit_rows(bits), pack_lowbit(_weights(rng, n, k, bits), bits)
    x = rng.standard_normal((37, k)).astype(np.float32)
    alone = np.concatenate([kernel(x[i : i + 1], packed, n) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 8, 9, 32, 37):
        batched = kernel(x[:rows], packed, n)
        assert np.array_equal(batched, alone[:rows]), f"rows differ in a call of {rows}"


@pytest.mark.skipif(
    "avx512_vnni" not in cpu_features().flags, reason="this CPU builds the AVX2 path anyway"
)
@pytest.mark.parametrize("bits", BITS)
def test_the_avx2_build_gives_the_vnni_builds_numbers(bits):
    """An AVX2-only machine (vpmaddubsw + vpmaddwd, and the fifth bits spread without
    AVX512BW's masks) computes the same exact int32 dots as VNNI's vpdpbusd, so a sequence
    gets the same logits on either kind of CPU."""
    flags = (f"-DCODE_BITS={bits}", "-mno-avx512vnni", "-mno-avxvnni", "-mno-avx512bw")
    avx2 = native._library(native.LOWBIT_ROWS_SOURCE, flags)
    assert avx2 is not None
    rng = np.random.default_rng(11)
    n, k = 200, 1536  # 200: the last group of 16 half full
    packed = pack_lowbit(_weights(rng, n, k, bits), bits)
    x = rng.standard_normal((9, k)).astype(np.float32) * 30
    assert np.array_equal(LowBitRows(avx2, bits)(x, packed, n), lowbit_rows(bits)(x, packed, n))


def test_a_bound_weight_gives_the_unbound_products_on_read_only_and_strided_inputs():
    """`LowBitRows.bind` takes a weight's addresses once (`native.address`: from the buffer
    where it is writable, numpy's way where it is not, as for a mapped file's weights); the
    rows it is then given may be views of a larger array."""
    rng = np.random.default_rng(5)
    n, k = 40, 128
    packed = pack_lowbit(_weights(rng, n, k, 4), 4)
    read_only = packed.copy()
    read_only.flags.writeable = False
    assert native.address(read_only) == read_only.ctypes.data
    assert native.address(packed) == packed.ctypes.data
    wide = rng.standard_normal((6, 2 * k)).astype(np.float32)
    x = wide[:, :k]  # not contiguous
    expected = lowbit_rows(4)(np.ascontiguousarray(x), packed, n)
    bound = lowbit_rows(4).bind(read_only, n)
    assert np.array_equal(bound(x), expected)
    assert np.array_equal(bound(x[:1]), expected[:1])
    with pytest.raises(ValueError, match="K = 96"):
        bound(np.zeros((1, 96), np.float32))


@pytest.mark.parametrize("bits", BITS)
def test_rows_normalized_by_the_kernel_are_rms_normalize_then_the_product(bits):
    """With `norm_eps` the kernel RMS-normalizes each row as it rounds it to int8
    (runtime/models/base.py `normed_linear`): the products of `rms_normalize`'s rows, up to
    the last bit of the norm (which may move a code at a rounding tie), and each row's
    result the same alone as in any batch."""
    from runtime.models.base import rms_normalize

    rng = np.random.default_rng(8)
    n, k, eps = 70, 576, 1e-5
    bound = lowbit_rows(bits).bind(pack_lowbit(_weights(rng, n, k, bits), bits), n)
    x = rng.standard_normal((11, k)).astype(np.float32) * rng.uniform(0.01, 50, (11, 1))
    x = x.astype(np.float32)
    fused, separate = bound(x, eps), bound(rms_normalize(x, eps))
    np.testing.assert_allclose(fused, separate, rtol=1e-3, atol=1e-3 * np.abs(separate).max())
    alone = np.concatenate([bound(x[i : i + 1], eps) for i in range(len(x))])
    assert np.array_equal(fused, alone)
    for rows in (2, 8, 9):
        assert np.array_equal(bound(x[:rows], eps), alone[:rows])
    with pytest.raises(ValueError, match="norm_eps"):
        bound(x, -1.0)


def test_bad_arguments_are_refused_before_the_kernel_runs():
    kernel = lowbit_rows(4)
    packed = pack_lowbit(_weights(np.random.default_rng(1), 16, 64, 4), 4)
    with pytest.raises(ValueError, match="packed"):
        kernel(np.zeros((1, 96), np.float32), packed, 16)
    with pytest.raises(ValueError, match="packed"):
        kernel(np.zeros((1, 64), np.float32), packed, 24)
    with pytest.raises(ValueError, match="input_scale"):
        kernel(np.zeros((1, 64), np.float32), packed, 16, np.ones(64, np.float64))
    with pytest.raises(ValueError, match="packed"):  # a 4-bit packing given to the 5-bit kernel
        lowbit_rows(5)(np.zeros((1, 64), np.float32), packed, 16)


needs_vnni = pytest.mark.skipif(lowbit_rows(8) is None, reason="8-bit codes need VNNI")


@needs_vnni
@pytest.mark.parametrize("n, k", [(61, 64), (256, 576), (1030, 640)])
def test_int8_groups_are_the_blockwise_rounded_rows_times_the_int8_weights(n, k):
    """The LM head's layout (`Int8GroupWeight`): int8 codes and bf16-rounded row scales as
    `Int8Weight` chooses them, times activations rounded per block of 32."""
    rng = np.random.default_rng(n + k)
    dense = rng.standard_normal((n, k)).astype(np.float32)
    weight = Int8GroupWeight.from_dense(dense)
    codes, scales = Int8Weight.quantized(torch.from_numpy(dense))
    stored = codes.numpy().astype(np.float64) * scales.double().numpy()[:, None]
    x = rng.standard_normal((5, k)).astype(np.float32)
    x[1] *= 40.0
    x[2, :INT8_BLOCK] = 0.0
    expected = blockwise_rounded(x) @ stored.T
    got = weight(x)
    assert got.shape == (5, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    alone = np.concatenate([weight(x[i : i + 1]) for i in range(len(x))])
    assert np.array_equal(alone, got)
