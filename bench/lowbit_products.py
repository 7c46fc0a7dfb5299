"""The 4-bit products of a SmolLM2 decode step, kernel by kernel: all 210 layer weights, as
the engine fuses them into 120 products (30 layers of q/k/v [960, 576], o [576, 576],
gate/up [3072, 576] and down [576, 1536]), on random Q4 weights, best of 5, ms per set, at
1 / 4 / 32 / 128 rows.

- lowbit_rows.c as this CPU builds it (runtime/kernels/lowbit_rows.c, the default);
- the same source built without AVX-512 (`-mno-avx512f`): the AVX2 path an AVX2-only CPU
  runs (vpmaddubsw + vpmaddwd, 256-bit), measured here;
- torch's int4 kernel (`Int4Weight`, bf16 activations; `LLMQ_TORCH_INT4=1`);
- fbgemm's fp16 (`Fp16Weight`: the AVX2 plan's kernel for the other weights).

Usage: .venv/bin/python bench/lowbit_products.py [--rows 1,4,32,128]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [N, K] of one SmolLM2 layer
LAYERS = 30


def products() -> dict[str, list[tuple[Callable[[np.ndarray], np.ndarray], int]]]:
    """Each kernel's 210 products, each with its K."""
    from runtime.kernels import native
    from runtime.kernels.gguf_blocks import quantize_groups
    from runtime.kernels.torch_backend import Fp16Weight, Int4Weight, LowBitWeight

    rng = np.random.default_rng(0)
    kernels: dict[str, list] = {"lowbit_rows.c": [], "lowbit_rows.c, AVX2 build": []}
    kernels |= {"torch int4": [], "fbgemm fp16": []}
    avx2_lib = native._library(native.LOWBIT_ROWS_SOURCE, ("-DCODE_BITS=4", "-mno-avx512f"))
    avx2 = native.LowBitRows(avx2_lib, 4) if avx2_lib is not None else None
    for n, k in SHAPES:
        q = quantize_groups((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
        packed = native.pack_lowbit(q, 4)
        if native.lowbit_rows(4) is not None:
            kernels["lowbit_rows.c"].append((LowBitWeight(q, 4, None), k))
        if avx2 is not None:
            kernels["lowbit_rows.c, AVX2 build"].append((lambda x, p=packed, n=n: avx2(x, p, n), k))
        kernels["torch int4"].append((Int4Weight(q, None), k))
        kernels["fbgemm fp16"].append((Fp16Weight(q.dequantize()), k))
    return {name: weights * LAYERS for name, weights in kernels.items() if weights}


def best_ms(run: Callable[[], None], repeat: int = 5) -> float:
    run()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,32,128")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]

    import torch

    from runtime.kernels.cpu import cpu_features

    torch.set_num_threads(cpu_features().cores)
    kernels = products()
    rng = np.random.default_rng(1)
    print(
        f"cpu: {cpu_features().level}, {cpu_features().cores} cores; SmolLM2's 210 layer "
        f"weights as {len(SHAPES) * LAYERS} fused products, ms per set (best of 5)"
    )
    print("| kernel | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("| --- |" + " --- |" * len(rows))
    for name, weights in kernels.items():
        cells = []
        for m in rows:
            xs = {k: rng.standard_normal((m, k)).astype(np.float32) for _, k in SHAPES}

            def one_set(xs: dict = xs, weights: list = weights) -> None:
                for w, k in weights:
                    w(xs[k])

            cells.append(f"{best_ms(one_set):.2f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
