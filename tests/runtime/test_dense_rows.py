"""runtime/kernels/dense_rows.c: fp16-weight products and LoRA deltas against numpy, each
row's result the same alone as in any batch (where numpy's BLAS and fbgemm block by batch)."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.kernels.native import dense_rows
from runtime.kernels.torch_backend import Fp16RowsWeight

pytestmark = pytest.mark.skipif(dense_rows() is None, reason="no C compiler for the kernel")


def _rows_alone(product, x: np.ndarray) -> np.ndarray:
    return np.concatenate([product(x[i : i + 1]) for i in range(len(x))])


@pytest.mark.parametrize("n, k", [(13, 64), (203, 576), (96, 1544)])
def test_fp16_product_is_numpys_and_the_same_in_any_batch(n, k):
    rng = np.random.default_rng(n)
    dense = rng.standard_normal((n, k)).astype(np.float32)
    weight = Fp16RowsWeight.from_dense(dense)
    x = rng.standard_normal((37, k)).astype(np.float32)
    half = dense.astype(np.float16).astype(np.float64)
    got = weight(x)
    np.testing.assert_allclose(got, x.astype(np.float64) @ half.T, rtol=1e-4, atol=1e-4)
    alone = _rows_alone(weight, x)
    for rows in (2, 5, 9, 32, 37):
        assert np.array_equal(weight(x[:rows]), alone[:rows]), f"rows differ in a call of {rows}"


def test_lora_rows_add_the_low_rank_product_to_the_named_rows_only():
    rng = np.random.default_rng(2)
    t, k, rank, n = 64, 200, 12, 301  # k and n with tails past the 8 lanes
    x = rng.standard_normal((t, k)).astype(np.float32)
    a = rng.standard_normal((rank, k)).astype(np.float32)
    bt = rng.standard_normal((rank, n)).astype(np.float32)
    base = rng.standard_normal((t, n)).astype(np.float32)
    rows = np.array([3, 7, 8, 40, 63])
    scales = np.array([1.0, 0.0, -0.5, 2.0, 1.0], np.float32)
    out = base.copy()
    dense_rows().lora(x, rows, scales, a, bt, out)
    expected = base.astype(np.float64)
    low = x[rows].astype(np.float64) @ a.T.astype(np.float64) * scales[:, None]
    expected[rows] += low @ bt.astype(np.float64)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-3)
    others = np.setdiff1d(np.arange(t), rows)
    assert np.array_equal(out[others], base[others]) and np.array_equal(out[7], base[7])
    for i, row in enumerate(rows):  # each row alone, at row 0 of a one-row call
        one = base[row : row + 1].copy()
        dense_rows().lora(x[row : row + 1], np.array([0]), scales[i : i + 1], a, bt, one)
        assert np.array_equal(one[0], out[row])


def test_bad_arguments_are_refused():
    kernel = dense_rows()
    x, a, bt = (np.zeros(s, np.float32) for s in ((2, 16), (4, 16), (4, 8)))
    with pytest.raises(ValueError, match="out must be"):
        kernel.lora(x, np.array([0]), np.ones(1, np.float32), a, bt, np.zeros((2, 9), np.float32))
    with pytest.raises(ValueError, match="inside x"):
        kernel.lora(x, np.array([2]), np.ones(1, np.float32), a, bt, np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match="multiple of 8"):
        kernel.fp16(np.zeros((1, 12), np.float32), np.zeros((3, 12), np.float16))
