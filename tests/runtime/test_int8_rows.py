"""runtime/kernels/int8_rows.c: the int8-weight product against an independent numpy
statement of its arithmetic, its rows' independence from their batch, and the fallback to
torch's kernel where it cannot take a weight. Its accuracy on the real heads is held by
tests/runtime/test_golden.py (teacher-forced top-1 against llama.cpp and float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.kernels.native import INT8_BLOCK, int8_rows
from runtime.kernels.torch_backend import Int8Weight
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
