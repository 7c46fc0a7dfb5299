"""An LM head (Gemma 3's 262k rows by default), each way the plan can take it, side by side
in one process: an int4 ranking rescored from the file's rows (`rescore`, `RescoredHead`),
the file's Q8_0 codes in int8_rows.c's grouped layout rounded in two passes (`groups`,
`Int8BlockGroupHead`), the same a row at a time (`rows`, `Int8BlockHead`), or fbgemm's
fp16 (`fp16`); at 1 and 32 query rows, interleaved repeats, medians, ratios against the
first kind; with each head's resident bytes and whether its top-1 per row matches the
float32 product's.

    .venv/bin/python bench/large_head.py [--repeat 7] [--kinds rescore,groups,rows]
    LLMQ_CPU_LEVEL=avx2 .venv/bin/python bench/large_head.py --model smollm2-135m-instruct \
        --kinds groups,rows,fp16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.gguf_file import GGUFFile  # noqa: E402
from runtime.kernels.cpu import cpu_features, default_plan  # noqa: E402
from runtime.kernels.torch_backend import TorchBackend  # noqa: E402
from runtime.registry import resolve  # noqa: E402

HEAD = "token_embd.weight"


def backend_for(kind: str) -> TorchBackend:
    """The plan with its head (any size) taken as `kind` says."""
    plan = default_plan()
    head, eight_bit = {
        "rescore": ("int4+rescore", "int8-block-groups"),
        "groups": ("file", "int8-block-groups"),
        "rows": ("file", "int8-blocks"),
        "fp16": ("fp16", "int8-block-groups"),
    }[kind]
    return TorchBackend(replace(plan, head=head, large_head=head, eight_bit=eight_bit))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--kinds", default="rescore,groups,rows")
    p.add_argument("--rows", default="1,32")
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    features = cpu_features()
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"cpu: {features.level}, {features.cores} cores; {now}")
    f = GGUFFile(resolve(args.model).path())
    kinds = args.kinds.split(",")
    heads = {k: backend_for(k).head(f, HEAD) for k in kinds}
    for k, head in heads.items():
        print(f"  {k:8s} {head.kind:24s} {head.nbytes / 2**20:7.1f} MiB")
    rng = np.random.default_rng(0)
    dense = None
    for rows in (int(r) for r in args.rows.split(",")):
        x = rng.standard_normal((rows, f.blocks(HEAD)[2][1])).astype(np.float32)
        if dense is None:
            dense = f.tensor(HEAD)  # [V, D] float32, for the top-1 check
        best = (x.astype(np.float64) @ dense.T.astype(np.float64)).argmax(axis=1)
        times = {k: [] for k in kinds}
        calls = 3 if rows > 1 else 10
        for head in heads.values():
            head(x)  # warm
        for _ in range(args.repeat):
            for k, head in heads.items():
                started = time.perf_counter()
                for _ in range(calls):
                    out = head(x)
                times[k].append((time.perf_counter() - started) / calls * 1e3)
        first = statistics.median(times[kinds[0]])
        for k, head in heads.items():
            median = statistics.median(times[k])
            same = int((np.asarray(head(x)).argmax(axis=1) == best).sum())
            print(
                f"rows {rows:3d} {k:8s} {median:8.2f} ms ({median / first:.2f}x {kinds[0]}'s)"
                f"  top-1 = float32's on {same}/{rows} rows"
            )
        del out


if __name__ == "__main__":
    main()
