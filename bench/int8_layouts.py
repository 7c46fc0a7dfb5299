"""int8_rows.c's two layouts of a file's Q8_0 / Q6_K codes, side by side in one process:
rows (`llmq_int8_blocks`, a weight row at a time) against groups (`llmq_int8_groups`, 16
rows side by side), at Gemma 3 270M's and SmolLM2's shapes, 1 and many activation rows.
Interleaved A/B repeats; medians and the ratio rows / groups.

    .venv/bin/python bench/int8_layouts.py [--repeat 7] [--rows 1,32,480]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import gguf
import numpy as np

from runtime.kernels.cpu_features import cpu_features
from runtime.kernels.gguf_blocks import read_eight_bit
from runtime.kernels.native import int8_rows, pack_int8_groups

Q = gguf.GGMLQuantizationType
# (name, n, k, type): Gemma 3 270M's 8-bit layer products and SmolLM2's Q8_0 head
SHAPES = [
    ("gemma ffn_down Q6_K", 640, 2048, Q.Q6_K),
    ("gemma attn_v Q8_0", 256, 640, Q.Q8_0),
    ("smollm2 head Q8_0", 49152, 576, Q.Q8_0),
]


def _codes(rng: np.random.Generator, n: int, k: int, qtype: Q):
    if qtype == Q.Q6_K:
        raw = rng.integers(0, 256, (n * k // 256, 210), dtype=np.uint8)
        raw[:, -2:] = np.array([2e-3], np.float16).view(np.uint8)
        raw = raw.reshape(n, -1)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    return read_eight_bit(raw, qtype, (n, k))


def _ms(fn, x, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--rows", default="1,32,480")
    p.add_argument("--fine", action="store_true", help="activations rounded in two passes")
    args = p.parse_args()
    kernel = int8_rows()
    print(f"cpu: {cpu_features().level}, {cpu_features().cores} cores")
    rng = np.random.default_rng(0)
    for name, n, k, qtype in SHAPES:
        q = _codes(rng, n, k, qtype)
        codes, scales = np.ascontiguousarray(q.codes), np.ascontiguousarray(q.scales)
        grouped = kernel.bind_groups(*pack_int8_groups(codes, scales), n, None)
        for rows in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            calls = max(3, int(2000 // rows))
            a = functools.partial(kernel.blocks, codes=codes, scales=scales, fine=args.fine)
            b = functools.partial(grouped, fine=args.fine)
            a(x), b(x)
            ta, tb = [], []
            for _ in range(args.repeat):
                ta.append(_ms(a, x, calls))
                tb.append(_ms(b, x, calls))
            ma, mb = statistics.median(ta), statistics.median(tb)
            figures = f"rows {ma:8.3f} ms  groups {mb:8.3f} ms  {ma / mb:5.2f}x"
            print(f"{name:22s} rows {rows:4d}: {figures}")


if __name__ == "__main__":
    main()
