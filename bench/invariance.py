"""Same request, same answer? Where a sequence's numbers depend on its batch, measured.

    python bench/invariance.py [--model smollm2-135m-instruct] [--prompts 8] [--tokens 16]
                               [--no-engine]

Part 1, kernels: for each product this CPU's plans use (numpy float32, fbgemm fp16, torch's
int4 / int8 / bf16), on three real layer shapes, is a row's result in a call of M rows bitwise
the row's result alone? Part 2, the engine as shipped (this CPU's plan): greedy requests run
cold and alone (the reference), then after a prefix-cache hit, batched among the other
prompts, and resumed (prompt + the first half of the reference's tokens as a prompt with
`resume`), comparing tokens and the logits of every sampled position.

CONTRACT's "same request, same answer" asks for identical tokens in every condition and
bitwise logits on the torch backend; this prints how far the engine is from that, and
which kernels stand in the way.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.harness import bench_parser, header, meta  # noqa: E402

ROW_COUNTS = (1, 2, 3, 5, 8, 16, 32, 64)
PROMPTS = [
    "Say hi.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain why the sky is blue in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Name a famous painter and one of their works.",
    "Give me a tip for learning to cook.",
    "Describe a cat in five words.",
]


def kernel_products(k: int, n: int) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
    """One `[n, k]` weight as each kernel of runtime/kernels keeps it."""
    import torch

    from runtime.kernels.gguf_blocks import GROUP_SIZE, GroupQuantized
    from runtime.kernels.native import lowbit_rows
    from runtime.kernels.torch_backend import (
        Bf16Weight,
        Fp16Weight,
        Int4Weight,
        Int8GroupWeight,
        Int8Weight,
        LowBitWeight,
    )

    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scales = (rng.random((n, k // GROUP_SIZE), dtype=np.float32) * 0.01).astype(np.float32)
    mins = (-8 * scales).astype(np.float32)
    q = GroupQuantized(codes, scales, mins)
    dense = q.dequantize()
    products: dict[str, Callable[[np.ndarray], np.ndarray]] = {
        "numpy float32": lambda x: x @ dense.T,
        "fbgemm fp16": Fp16Weight(dense),
        "torch int4": Int4Weight(q, None),
        "int8 per row (int8_rows.c, else torch's)": Int8Weight.from_dense(dense),
    }
    if torch.backends.mkldnn.is_available():
        products["torch bf16"] = Bf16Weight.from_dense(dense)
    for bits in (4, 5):  # codes below 16 are valid 5-bit codes too
        if lowbit_rows(bits) is not None:
            products[f"{bits}-bit (lowbit_rows.c)"] = LowBitWeight(q, bits, None)
    if lowbit_rows(8) is not None:
        products["int8 in groups (lowbit_rows.c)"] = Int8GroupWeight.from_dense(dense)
    return products


def kernel_table(shapes: Sequence[tuple[int, int]]) -> list[str]:
    rng = np.random.default_rng(1)
    lines = [
        "| kernel | weight [N, K] | row counts M where rows differ from the row alone |",
        "| --- | --- | --- |",
    ]
    for k, n in shapes:
        x = rng.standard_normal((max(ROW_COUNTS), k)).astype(np.float32)
        for name, product in kernel_products(k, n).items():
            alone = np.concatenate([product(x[i : i + 1]) for i in range(max(ROW_COUNTS))])
            differ = [m for m in ROW_COUNTS if not np.array_equal(product(x[:m]), alone[:m])]
            lines.append(f"| {name} | [{n}, {k}] | {differ or 'none: row-invariant'} |")
    return lines


class Recorder:
    """The logits each request's sampled positions got, by request id."""

    def __init__(self) -> None:
        self.rows: dict[str, list[np.ndarray]] = {}

    def attach(self, generator: Any) -> None:
        sample = generator.runner.host_rows.sample  # a bench may look inside

        def recording(logits: np.ndarray, rows: list[Any]) -> Any:
            for values, row in zip(logits, rows, strict=True):
                self.rows.setdefault(row.request_id, []).append(np.array(values))
            return sample(logits, rows)

        generator.runner.host_rows.sample = recording


def run(engine: Any, requests: list[tuple[str, list[int], int]], tokens: int, cache: bool):
    """Greedy `tokens` per (id, prompt, resume), all in one generator: -> ids, logits."""
    from runtime.sampling import SamplingParams

    generator = engine.new_generator()
    recorder = Recorder()
    recorder.attach(generator)
    out: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    for rid, prompt, resume in requests:
        params = SamplingParams(max_tokens=tokens - resume, temperature=0.0, ignore_eos=True)
        generator.add(rid, prompt, params, cache_prompt=cache, resume=resume)
    while len(generator):
        for event in generator.step():
            out[event.request_id].append(event.token_id)
    return out, recorder.rows


def prompt_ids(engine: Any, text: str) -> list[int]:
    """The prompt as a one-message chat, or as plain text where the model has no chat
    template (Gemma 3's GGUF)."""
    from runtime.errors import ChatTemplateMissingError

    try:
        return engine.encode_chat([{"role": "user", "content": text}])
    except ChatTemplateMissingError:
        return engine.encode(text)


def engine_table(model: str, n_prompts: int, tokens: int, plan: str) -> list[str]:
    from runtime.engine import Engine, EngineConfig
    from runtime.kernels.cpu import cpu_features, row_invariant_plan

    kernels = None  # this CPU's plan
    if plan == "row-invariant":  # only kernels part 1 finds row-invariant on this CPU
        kernels = row_invariant_plan(cpu_features())
    engine = Engine.load(model, EngineConfig(kernels=kernels))
    prompts = [prompt_ids(engine, p) for p in PROMPTS[:n_prompts]]
    reference, ref_logits = {}, {}
    for i, prompt in enumerate(prompts):  # cold and alone, no cache written
        ids, logits = run(engine, [(f"p{i}", prompt, 0)], tokens, cache=False)
        reference[i], ref_logits[i] = ids[f"p{i}"], logits[f"p{i}"]

    conditions: dict[str, tuple[dict[int, list[int]], dict[int, list[np.ndarray]]]] = {}
    cached_ids, cached_logits = {}, {}
    for i, prompt in enumerate(prompts):  # the first run fills the cache, the second hits it
        run(engine, [(f"w{i}", prompt, 0)], 1, cache=True)
        ids, logits = run(engine, [(f"c{i}", prompt, 0)], tokens, cache=True)
        cached_ids[i], cached_logits[i] = ids[f"c{i}"], logits[f"c{i}"]
    conditions["after a prefix-cache hit"] = (cached_ids, cached_logits)
    ids, logits = run(engine, [(f"b{i}", p, 0) for i, p in enumerate(prompts)], tokens, False)
    conditions[f"batched ({len(prompts)} together)"] = (
        {i: ids[f"b{i}"] for i in range(len(prompts))},
        {i: logits[f"b{i}"] for i in range(len(prompts))},
    )
    half = tokens // 2
    resumed = [(f"r{i}", p + reference[i][:half], half) for i, p in enumerate(prompts)]
    ids, logits = run(engine, resumed, tokens, cache=False)
    conditions["resumed after half its tokens"] = (
        {i: reference[i][:half] + ids[f"r{i}"] for i in range(len(prompts))},
        {i: ref_logits[i][:half] + logits[f"r{i}"] for i in range(len(prompts))},
    )

    lines = [
        f"engine: {model}, {engine.backend.name} backend, plan {engine.backend.describe()}",
        "",
        "| condition | requests with the reference's tokens | sampled positions with "
        "bitwise-equal logits | max abs logit difference |",
        "| --- | --- | --- | --- |",
    ]
    for name, (ids_by, logits_by) in conditions.items():
        same_tokens = sum(ids_by[i] == reference[i] for i in ids_by)
        equal = total = 0
        worst = 0.0
        for i in ids_by:
            for a, b in zip(logits_by[i], ref_logits[i], strict=False):
                total += 1
                equal += bool(np.array_equal(a, b))
                worst = max(worst, float(np.abs(a - b).max()))
        lines.append(
            f"| {name} | {same_tokens} / {len(ids_by)} | {equal} / {total} | {worst:.3g} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    p = bench_parser(__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", type=int, default=8, help=f"at most {len(PROMPTS)}")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens per request")
    p.add_argument("--no-engine", dest="engine", action="store_false", help="kernels only")
    p.add_argument(
        "--plan",
        choices=("cpu", "row-invariant"),
        default="cpu",
        help="the engine's kernels: this CPU's plan, or its row-invariant one (cpu.py)",
    )
    args = p.parse_args(argv)
    from runtime.kernels.cpu import cpu_features
    from runtime.kernels.torch_backend import TorchBackend

    TorchBackend()  # torch's threads as the engine sets them
    lines = [f"cpu: {cpu_features().level}, {cpu_features().cores} cores", ""]
    lines += kernel_table([(576, 960), (1536, 576), (2048, 640)])
    if args.engine:
        prompts = min(args.prompts, len(PROMPTS))
        lines += ["", *engine_table(args.model, prompts, args.tokens, args.plan)]
    print("\n".join([*header("llmq: same request, same answer", meta(sys.argv)), *lines]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
