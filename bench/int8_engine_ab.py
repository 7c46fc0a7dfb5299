"""Q8_0 / Q6_K kernels end to end, side by side in one process: the engine loaded once per
kernel plan, then prefill and decode timed in turn (ABAB, `--repeat` rounds), medians and
ratios against the first variant; with `--top1`, each plan's teacher-forced top-1 against
the float32 reference (tests/fixtures/reference).

Variants (runtime/kernels/cpu.py):
  groups   the default plan: int8_rows.c's grouped layout (`Int8BlockGroupWeight`)
  rows     `LLMQ_INT8_LAYOUT=rows`: a weight row at a time (`Int8BlockWeight`)
  bf16     the 8-bit weights as the plan's dense kind "bf16" (AMX's bf16 on an AMX CPU:
           the path before the row-invariant default, not row-invariant there)
  fp16     the same with fbgemm's fp16
  file     a head of over LARGE_HEAD_ROWS rows from the file's codes (two-pass int8)
  rescore  such a head as an int4 ranking rescored from the file (`RescoredHead`)

    .venv/bin/python bench/int8_engine_ab.py --models gemma-3-270m --variants groups,rows,bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.engine import DECODE_TOKENS, prompt_ids  # noqa: E402
from runtime.engine import Engine, EngineConfig  # noqa: E402
from runtime.kernels.cpu import cpu_features, default_plan  # noqa: E402
from runtime.models.base import BatchLayout, SequenceChunk  # noqa: E402
from runtime.registry import resolve  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures" / "reference"


def plan_of(variant: str, threads: int | None = None):
    plan = default_plan()
    plan = replace(plan, threads=threads or plan.threads)
    return {
        "groups": replace(plan, eight_bit="int8-block-groups"),
        "rows": replace(plan, eight_bit="int8-blocks"),
        "bf16": replace(plan, other="bf16", eight_bit=""),
        "fp16": replace(plan, other="fp16", eight_bit=""),
        "file": replace(plan, eight_bit="int8-block-groups", large_head="file"),
        "rescore": replace(plan, eight_bit="int8-block-groups", large_head="int4+rescore"),
    }[variant]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prefill_s(engine: Engine, ids: list[int]) -> float:
    events = engine.generate(ids, greedy(1))
    started = time.perf_counter()
    next(events)
    elapsed = time.perf_counter() - started
    for _ in events:
        pass
    return elapsed


def decode_tok_s(engine: Engine, ids: list[int], tokens: int) -> tuple[float, list[int]]:
    stamps, out = [], []
    for event in engine.generate(ids, greedy(tokens + 1)):
        stamps.append(time.perf_counter())
        out.append(event.token_id)
    return tokens / (stamps[-1] - stamps[0]), out


def top1_vs_float32(engine: Engine, model_id: str) -> float | None:
    ref = json.loads((FIXTURES / f"{model_id}.json").read_text())
    if not ref.get("transformers_supported"):
        return None
    agree = total = 0
    for prompt in ref["prompts"]:
        other = prompt["transformers"]
        ids = prompt["token_ids"] + other["greedy"]
        cache = engine.model.new_cache(len(ids))
        layout = BatchLayout([SequenceChunk(cache, 0, len(ids))])
        logits = engine.model.logits(engine.model.forward(np.asarray(ids), layout))
        ours = engine.model.ops.to_host(logits)[:-1].argmax(axis=1)
        expected = np.asarray(other["teacher_forced_argmax"])
        agree += int((ours == expected).sum())
        total += len(expected)
    return agree / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gemma-3-270m,smollm2-135m-instruct")
    p.add_argument("--variants", default="groups,rows,bf16")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--prefill", type=int, default=480)
    p.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS)
    p.add_argument("--top1", action="store_true", help="teacher-forced top-1 vs float32")
    p.add_argument("--threads", type=int, default=None, help="default: the plan's (all cores)")
    args = p.parse_args()
    features = cpu_features()
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    threads = args.threads or features.cores
    print(f"cpu: {features.level}, {features.cores} cores, {threads} threads; {now}")
    variants = args.variants.split(",")
    for model_id in args.models.split(","):
        path = resolve(model_id).path()
        ids = prompt_ids(path)
        prefill_ids = ids["prefill_ids"][: args.prefill]
        engines = {}
        for v in variants:
            config = EngineConfig(
                prefix_cache=False, kernels=plan_of(v, args.threads), backend="torch"
            )
            engines[v] = Engine.load(str(path), config)
            kinds = engines[v].model.weight_kinds()
            eight_bit = engines[v].backend.describe().get("8-bit weights", "")
            print(f"{model_id} {v}: {eight_bit}; {kinds}")
            for _ in engines[v].generate(ids["warmup_ids"], greedy(4)):
                pass
        prefill = {v: [] for v in variants}
        decode = {v: [] for v in variants}
        tokens = {}
        for rep in range(args.repeat):
            order = variants[rep % len(variants) :] + variants[: rep % len(variants)]
            for v in order:
                prefill[v].append(prefill_s(engines[v], prefill_ids) * 1e3)
                rate, tokens[v] = decode_tok_s(engines[v], ids["decode_ids"], args.decode_tokens)
                decode[v].append(rate)
        base = variants[0]
        pm = {v: statistics.median(prefill[v]) for v in variants}
        dm = {v: statistics.median(decode[v]) for v in variants}
        print(
            f"{model_id}: prefill {len(prefill_ids)} tokens (ms, median of {args.repeat}); "
            f"decode {args.decode_tokens} tokens at {len(ids['decode_ids'])} context (tok/s)"
        )
        for v in variants:
            same = "same tokens" if tokens[v] == tokens[base] else "tokens differ"
            top1 = ""
            if args.top1:
                t = top1_vs_float32(engines[v], model_id)
                top1 = f"  top-1 vs float32 {t:.2%}" if t is not None else ""
            print(
                f"  {v:8s} prefill {pm[v]:8.1f} ms ({pm[v] / pm[base]:.2f}x {base}'s time)  "
                f"decode {dm[v]:6.2f} tok/s ({dm[v] / dm[base]:.2f}x)  {same}{top1}"
                f"  [prefill {', '.join(f'{t:.0f}' for t in prefill[v])}]"
            )


if __name__ == "__main__":
    main()
