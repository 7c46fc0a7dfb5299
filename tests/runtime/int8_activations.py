"""The activation rounding that runtime/kernels/int8_rows.c and lowbit_rows.c state, written
independently in numpy, for their tests to compare against."""

from __future__ import annotations

import numpy as np

from runtime.kernels.native import INT8_BLOCK


def blockwise_rounded(x: np.ndarray) -> np.ndarray:
    """Each row rounded to int8 per block of 32 as the kernels state it (float32 scale =
    peak / 127, code = round-half-even(value * (127 / peak)) in float32), back in float64."""
    blocks = x.astype(np.float32).reshape(len(x), -1, INT8_BLOCK)
    peak = np.abs(blocks).max(axis=2, keepdims=True)
    scale = peak / np.float32(127)
    inverse = np.where(peak > 0, np.float32(127) / np.where(peak > 0, peak, 1), 0)
    codes = np.round(blocks * inverse.astype(np.float32))
    return (codes.astype(np.float64) * scale).reshape(x.shape)
