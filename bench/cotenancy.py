"""Single-stream decode on a quiet machine and beside one busy process, llmq and llama.cpp
alike, on the same GGUF file.

    python bench/cotenancy.py [--models smollm2-135m-instruct] [--tokens 48] [--repeat 3]
                              [--no-llama]

A worker shares its machine with the API, Redis and other processes. Each engine runs in a
child process of its own: it loads, warms up, decodes `--tokens` greedy tokens quiet, then
starts one busy loop (`python -c 'while True: pass'`, the same for every engine), waits a
second and decodes again. Printed per engine: quiet and busy tok/s (best of `--repeat`)
and busy / quiet. Engines:

- `llmq`: the torch backend as shipped: its thread count follows the load
  (runtime/kernels/core_share.py);
- `llmq-fixed`: the same with `LLMQ_FIXED_THREADS=1` (threads = cores, always: the old
  behaviour), to show what the thread policy gains beside the busy process and costs quiet;
- `llama.cpp`: llama-cpp-python with threads = cores, as bench/engine.py runs it.

Targets: llmq keeps >= 0.45 of its quiet decode beside the busy process, and its quiet
decode is within 5% of `llmq-fixed`'s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.harness import child_main, commit, llama_cpp_version, run_child  # noqa: E402

SCRIPT = Path(__file__).resolve()
PROMPT = "Write a long story about a dragon who learns to bake bread in a small village."
BUSY_SETTLE_S = 1.0  # long enough for the thread count to follow (core_share.WINDOW)
KEEP_TARGET, QUIET_COST_TARGET = 0.45, 0.05


def quiet_and_busy(decode: Callable[[], float], repeat: int) -> dict[str, float]:
    """Best decode rate of `repeat` runs quiet, then of `repeat` runs beside one busy loop."""
    quiet = max(decode() for _ in range(repeat))
    busy_loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(BUSY_SETTLE_S)
        busy = max(decode() for _ in range(repeat))
    finally:
        busy_loop.kill()
        busy_loop.wait()
    return {"quiet_tps": quiet, "busy_tps": busy, "loadavg_1m": os.getloadavg()[0]}


def child_ours(job: dict[str, Any]) -> dict[str, Any]:
    from runtime.engine import Engine
    from runtime.kernels import core_share
    from runtime.sampling import SamplingParams

    engine = Engine.load(job["model"])
    ids = engine.encode(PROMPT)
    params = SamplingParams(max_tokens=job["tokens"] + 1, temperature=0.0, ignore_eos=True)

    def decode() -> float:
        stamps = [time.perf_counter() for _ in engine.generate(ids, params)]
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    decode()  # warm-up
    result = quiet_and_busy(decode, job["repeat"])
    shared = core_share._shared
    return {
        **result,
        "kernels": engine.backend.describe(),
        "threads_at_end": shared.threads if shared else None,
        "thread_changes": shared.changes if shared else None,
    }


def child_llama(job: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp
    import numpy as np

    from runtime.engine import Engine

    ids = Engine.load(job["model"]).encode(PROMPT)  # the same tokens as ours
    llm = llama_cpp.Llama(
        model_path=job["path"], n_ctx=1024, n_threads=os.cpu_count() or 1, verbose=False
    )
    n_vocab = llm.n_vocab()

    def argmax_last() -> int:
        logits = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(n_vocab,)).argmax())

    def decode() -> float:
        llm.reset()
        llm.eval(ids)
        token = argmax_last()
        started = time.perf_counter()
        for _ in range(job["tokens"]):
            llm.eval([token])
            token = argmax_last()
        return job["tokens"] / (time.perf_counter() - started)

    decode()
    return quiet_and_busy(decode, job["repeat"])


CHILDREN = {"ours": child_ours, "llama": child_llama}


def render(rows: list[tuple[str, str, dict[str, Any]]], cpu: str) -> str:
    lines = [
        f"cpu: {cpu}, {os.cpu_count()} cores; commit {commit()}; "
        f"llama-cpp-python {llama_cpp_version()}",
        "",
        "| model | engine | quiet tok/s | beside one busy loop | busy / quiet | threads at end |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for model, engine, r in rows:
        lines.append(
            f"| {model} | {engine} | {r['quiet_tps']:.1f} | {r['busy_tps']:.1f} | "
            f"{r['busy_tps'] / r['quiet_tps']:.2f} | {r.get('threads_at_end', '')} |"
        )
    lines.append("")
    for model in dict.fromkeys(m for m, _, _ in rows):
        by = {e: r for m, e, r in rows if m == model}
        ours, fixed = by["llmq"], by["llmq-fixed"]
        keep = ours["busy_tps"] / ours["quiet_tps"]
        cost = 1 - ours["quiet_tps"] / fixed["quiet_tps"]
        lines.append(
            f"{model}: llmq keeps {keep:.2f} of quiet decode beside a busy loop (target >= "
            f"{KEEP_TARGET}: {'MET' if keep >= KEEP_TARGET else 'MISSED'}); quiet cost vs fixed "
            f"threads {cost:+.1%} (target <= {QUIET_COST_TARGET:.0%}: "
            f"{'MET' if cost <= QUIET_COST_TARGET else 'MISSED'})"
        )
        if "llama.cpp" in by:
            llama = by["llama.cpp"]
            lines.append(
                f"{model}: llama.cpp keeps {llama['busy_tps'] / llama['quiet_tps']:.2f}; llmq / "
                f"llama.cpp quiet {ours['quiet_tps'] / llama['quiet_tps']:.2f}x, busy "
                f"{ours['busy_tps'] / llama['busy_tps']:.2f}x"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="smollm2-135m-instruct", help="comma-separated ids")
    p.add_argument("--tokens", type=int, default=48, help="greedy tokens per decode run")
    p.add_argument("--repeat", type=int, default=3, help="runs per condition (best is kept)")
    p.add_argument("--no-llama", dest="llama", action="store_false", help="skip llama.cpp")
    p.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child_main(CHILDREN, args.child)
    from runtime.kernels.cpu import cpu_features
    from runtime.registry import resolve

    env = dict(os.environ)
    fixed_env = {**env, "LLMQ_FIXED_THREADS": "1"}
    rows = []
    for model in args.models.split(","):
        job = {
            "model": model,
            "path": str(resolve(model).path()),
            "tokens": args.tokens,
            "repeat": args.repeat,
        }
        engines = [("llmq", "ours", env), ("llmq-fixed", "ours", fixed_env)]
        if args.llama:
            engines.append(("llama.cpp", "llama", env))
        for name, kind, child_env in engines:
            result = run_child(SCRIPT, kind, job, child_env)
            print(f"  {model} {name}: {result}", file=sys.stderr, flush=True)
            rows.append((model, name, result))
    print(render(rows, cpu_features().level))
    return 0


if __name__ == "__main__":
    sys.exit(main())
