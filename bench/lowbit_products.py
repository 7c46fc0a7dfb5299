"""The 4-bit products of a SmolLM2 decode step, kernel by kernel: all 210 layer weights, as
the engine fuses them into 120 products (30 layers of q/k/v [960, 576], o [576, 576],
gate/up [3072, 576] and down [576, 1536]), on random Q4 weights, best of 5, ms per set, at
1 / 4 / 32 / 128 rows.

- lowbit_rows.c as this CPU builds it (runtime/kernels/lowbit_rows.c, the default);
- the same source built without AVX-512 (`-mno-avx512f`): the AVX2 path an AVX2-only CPU
  runs (vpmaddubsw + vpmaddwd, 256-bit), measured here;
- torch's int4 kernel (`Int4Weight`, bf16 activations; `LLMQ_TORCH_INT4=1`);
- fbgemm's fp16 (`Fp16Weight`: the AVX2 plan's kernel for the other weights).

With `--types`: each quant type a Q4_K_M / Q5_K_M / Q3_K_M / Q2_K / IQ4 / MXFP4 file holds
beyond Q4_K / Q6_K / Q8_0, one Llama 3.2 1B layer's four fused products (qkv [3072, 2048],
o [2048, 2048], gate/up [16384, 2048], down [2048, 8192]) on random valid blocks: the
kernel the plan now gives it (its codes) against the dense fp16 copy it had before (the
plan's `other` kind: fbgemm's fp16 on AVX-512, dense_rows.c's on AVX2), ms per layer and
bytes per weight held.

Usage: .venv/bin/python bench/lowbit_products.py [--rows 1,4,32,128] [--types]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import replace
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


def best_ms(
    run: Callable[[], None], repeat: int = 5, clock: Callable[[], float] = time.perf_counter
) -> float:
    run()
    best = float("inf")
    for _ in range(repeat):
        start = clock()
        run()
        best = min(best, clock() - start)
    return best * 1000


def ms_per_set(
    products: list[tuple[Callable[[np.ndarray], np.ndarray], int]],
    ks: list[int],
    rows: list[int],
    rng: np.random.Generator,
    repeat: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> list[str]:
    """A table's cells: for each row count, `best_ms` of running every product once on
    random rows of its K (one input per K in `ks`, drawn in that order)."""
    cells = []
    for m in rows:
        xs = {k: rng.standard_normal((m, k)).astype(np.float32) for k in ks}

        def one_set(xs: dict = xs) -> None:
            for w, k in products:
                w(xs[k])

        cells.append(f"{best_ms(one_set, repeat, clock):.2f}")
    return cells


LAYER_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]  # Llama 3.2 1B
NEW_TYPES = ("Q5_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "MXFP4")


def type_products(rows: list[int], repeat: int = 5, cpu_time: bool = False) -> None:
    """`--types`: each new type's layer on its kernel against its old fp16 copy."""
    import gguf

    from runtime.kernels.cpu import cpu_features, row_invariant_plan
    from runtime.kernels.torch_backend import TorchBackend
    from tests.runtime.quant_blocks import random_blocks

    plan = row_invariant_plan(cpu_features())
    backend = TorchBackend(replace(plan, threads=1) if cpu_time else plan)
    clock = time.process_time if cpu_time else time.perf_counter
    rng = np.random.default_rng(0)
    weights = sum(n * k for n, k in LAYER_SHAPES)
    print(
        f"cpu: {cpu_features().level}, {cpu_features().cores} cores; one Llama 3.2 1B layer "
        f"({weights / 1e6:.1f}M weights, 4 fused products), ms per layer (best of {repeat}"
        f"{', CPU time on one thread' if cpu_time else ''})"
    )
    print("| type | kernel | bytes/weight (file) | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("| --- | --- | --- |" + " --- |" * len(rows))
    for name in NEW_TYPES:
        qtype = gguf.GGMLQuantizationType[name]
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        ours, dense = [], []
        for n, k in LAYER_SHAPES:
            raw = random_blocks(qtype, n, k, rng)
            ours.append((_built(backend, raw, qtype, n, k), k))
            values = gguf.quants.dequantize(raw, qtype).reshape(n, k)
            dense.append((backend._dense(backend.plan.other, values), k))
        for label, layer in ((ours[0][0].kind, ours), (f"{backend.plan.other} (before)", dense)):
            held = sum(w.nbytes for w, _ in layer) / weights
            cells = ms_per_set(layer, [k for _, k in layer], rows, rng, repeat, clock)
            file_bytes = block_bytes / block_size
            print(
                f"| {name} | {label} | {held:.3f} ({file_bytes:.3f}) | " + " | ".join(cells) + " |",
                flush=True,
            )
        del ours, dense


def _built(backend, raw: np.ndarray, qtype, n: int, k: int):
    """The weight the backend builds from a file holding `raw` (a one-tensor GGUF)."""
    import tempfile

    import gguf

    from runtime.gguf_file import GGUFFile
    from runtime.kernels import TensorPart

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "w.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_tensor("w", raw, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return backend.linear(GGUFFile(path), [TensorPart("w")])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,32,128")
    parser.add_argument("--types", action="store_true", help="the quant types, see above")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs, the best kept")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="--types on one thread, timed by the process's CPU time (a machine shared with "
        "other work: its wall time measures the others)",
    )
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.types:
        type_products(rows, args.repeat, args.cpu_time)
        return

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
        cells = ms_per_set(weights, [k for _, k in SHAPES], rows, rng)
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
