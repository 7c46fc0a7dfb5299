"""Valid raw GGUF blocks of any quant type from random bytes, for the kernel tests and
bench/lowbit_products.py: gguf can dequantize the K-quants, IQ4 and MXFP4 but quantizes
none of them, so their blocks are random codes and sub-block scales (every bit pattern is
a valid one) with the float factors set small."""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
# where each type keeps its float16 factor(s) inside a block: (byte offset, count);
# MXFP4 keeps a byte exponent at offset 0 instead
FLOAT16_FIELDS = {
    Q.Q4_0: (0, 1),
    Q.Q4_1: (0, 2),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208, 1),
    Q.Q3_K: (108, 1),
    Q.Q2_K: (80, 2),
    Q.IQ4_NL: (0, 1),
    Q.IQ4_XS: (0, 1),
}


def random_blocks(
    qtype: Q, rows: int, cols: int, seed: int | np.random.Generator = 0
) -> np.ndarray:
    """`[rows, bytes per row]` uint8: random bytes, the float16 factors in 0.001..0.01 and
    MXFP4's exponents near 2^-6; `seed` may be a generator to draw from."""
    rng = np.random.default_rng(seed)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_size, block_bytes), dtype=np.uint8)
    if qtype == Q.MXFP4:
        raw[..., 0] = rng.integers(118, 124, raw.shape[:2])
    else:
        offset, count = FLOAT16_FIELDS[qtype]
        halves = rng.uniform(0.001, 0.01, (rows, cols // block_size, count)).astype(np.float16)
        raw[..., offset : offset + 2 * count] = halves.view(np.uint8)
    return raw.reshape(rows, -1)
