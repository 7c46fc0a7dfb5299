"""How far the LM head's logits are from float32 products of the file's head, per rank band,
and what a decode step costs when one of its rows needs the file's precision.

Errors: max |logit - reference| at the reference's ranks 1-8, 9-32 and the rest, over every
position of the reference prompts (tests/fixtures/reference/*.json), the reference being
the head dequantized by `gguf.quants.dequantize` times the same hidden states in float64.
Heads: the plan's fast product (what every row got before, what a greedy row gets now),
the file's product (`FileHead`: what a logprobs / sampled row gets now) and bf16 dense (the
GPU's head, runtime/kernels/device_backend.py, here on the CPU). Cost: the median decode
step of a batch of greedy rows, and of the same batch with one row asking for a
temperature or for logprobs (the file's head built before timing; its build time shown),
and the head alone at those batch sizes.

    .venv/bin/python bench/head_precision.py [--models smollm2-135m-instruct,gemma-3-270m]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.engine import Engine, EngineConfig  # noqa: E402
from runtime.gguf_file import GGUFFile  # noqa: E402
from runtime.kernels.cpu import cpu_features  # noqa: E402
from runtime.kernels.heads import head_logits  # noqa: E402
from runtime.models.base import BatchLayout, SequenceChunk  # noqa: E402
from runtime.registry import ModelSpec, resolve  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "reference"
BANDS = (("1-8", slice(0, 8)), ("9-32", slice(8, 32)), ("rest", slice(32, None)))


class Product:
    """A head stand-in: `fn(hidden)` -> logits, so `model.logits` keeps its scale and cap."""

    def __init__(self, fn, shape) -> None:
        self.fn, self.shape, self.kind = fn, shape, "stand-in"

    def __call__(self, hidden):
        return self.fn(hidden)


def dequantized_head(path: Path) -> np.ndarray:
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    t = tensors.get("output.weight") or tensors["token_embd.weight"]
    return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)


def logits_with(model, head, hidden: np.ndarray) -> np.ndarray:
    kept, model.output = model.output, head
    try:
        return model.logits(hidden)
    finally:
        model.output = kept


def band_errors(got: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    order = np.argsort(-ref, axis=1)  # [L, V]
    out = {}
    for name, band in BANDS:
        idx = order[:, band]
        diff = np.take_along_axis(got, idx, 1) - np.take_along_axis(ref, idx, 1)
        out[name] = float(np.abs(diff).max())
    return out


def precision(engine: Engine, path: Path, prompts: list[list[int]]) -> None:
    model, weight = engine.model, dequantized_head(path)
    w64 = torch.from_numpy(weight).double()
    w16 = torch.from_numpy(weight).to(torch.bfloat16)
    heads = {
        "f32": Product(
            lambda h: (torch.from_numpy(h).double() @ w64.T).float().numpy(), weight.shape
        ),
        "bf16 (GPU's)": Product(
            lambda h: (
                torch.nn.functional.linear(torch.from_numpy(h).bfloat16(), w16).float().numpy()
            ),
            weight.shape,
        ),
    }
    worst: dict[str, dict[str, float]] = {}
    same_argmax = {"fast": 0, "file": 0}
    rows = 0
    for ids in prompts:
        cache = model.new_cache(len(ids))
        hidden = model.forward(np.asarray(ids), BatchLayout([SequenceChunk(cache, 0, len(ids))]))
        ref = logits_with(model, heads["f32"], hidden)
        got = {
            f"fast ({model.output.kind})": model.logits(hidden),
            "file (exact rows)": model.logits(hidden, True),
            "bf16 (GPU's)": logits_with(model, heads["bf16 (GPU's)"], hidden),
        }
        for name, logits in got.items():
            errors = band_errors(logits, ref)
            worst[name] = {k: max(v, worst.get(name, {}).get(k, 0.0)) for k, v in errors.items()}
        same_argmax["fast"] += int(
            (got[f"fast ({model.output.kind})"].argmax(1) == ref.argmax(1)).sum()
        )
        same_argmax["file"] += int((got["file (exact rows)"].argmax(1) == ref.argmax(1)).sum())
        rows += len(ids)
    for name, errors in worst.items():
        bands = "  ".join(f"{k} {v:.4f}" for k, v in errors.items())
        print(f"  {name:<28} max |err| by reference rank: {bands}")
    fast, file = same_argmax["fast"], same_argmax["file"]
    print(f"  argmax = float32's: fast {fast}/{rows}, file {file}/{rows}")


def step_times(engine: Engine, batch: int, extra: SamplingParams | None, steps: int) -> float:
    """Median seconds of a decode step of `batch` greedy rows (one replaced by `extra`)."""
    generator = engine.new_generator()
    greedy = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        params = extra if (extra is not None and i == 0) else greedy
        generator.add(f"r{i}", [20 + 7 * i + j for j in range(16)], params)
    while any(s.prefilling for s in generator._running) or generator._waiting:
        generator.step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        generator.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def head_times(engine: Engine, batches: list[int], repeat: int) -> None:
    """The head alone, the least of `repeat` interleaved runs (steadier than whole steps on
    a shared machine): every row fast, one row of the batch exact, every row exact."""
    head = engine.model.output
    if getattr(head, "full", None) is None:
        return
    rng = np.random.default_rng(0)
    for batch in batches:
        x = rng.standard_normal((batch, head.shape[1])).astype(np.float32)
        one = np.arange(batch) == 0
        runs = {"fast": None, "1 row exact": one, "all exact": True}
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(repeat):
            for name, exact in runs.items():
                started = time.perf_counter()
                head_logits(head, x, exact)
                best[name] = min(best[name], time.perf_counter() - started)
        cells = ", ".join(f"{name} {1e3 * t:.2f} ms" for name, t in best.items())
        print(f"  head alone, {batch} rows: {cells}")


def cost(engine: Engine, batches: list[int], steps: int) -> None:
    """Step times with every row on the fast head (as before the file's head existed), then
    with the rows that need it on the file's head."""
    full = getattr(engine.model.output, "full", None)
    if full is not None:
        engine.model.output.full = None
        _cost(engine, batches, steps, "every row fast")
        engine.model.output.full = full
        started = time.perf_counter()
        _ = full.weight
        print(f"  file head built on first use in {time.perf_counter() - started:.2f} s")
    _cost(engine, batches, steps, "exact rows on the file's head")


def _cost(engine: Engine, batches: list[int], steps: int, label: str) -> None:
    extras = {
        "all greedy": None,
        "+1 temperature row": SamplingParams(
            max_tokens=steps + 8, temperature=0.8, seed=1, ignore_eos=True
        ),
        "+1 logprobs=20 row": SamplingParams(
            max_tokens=steps + 8, temperature=0.0, logprobs=20, ignore_eos=True
        ),
    }
    for batch in batches:
        cells = [
            f"{name} {1e3 * step_times(engine, batch, extra, steps):.1f} ms"
            for name, extra in extras.items()
        ]
        print(f"  {label}: decode step, {batch} rows: " + ", ".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m-instruct,gemma-3-270m")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args()
    features = cpu_features()
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"cpu: {features.level}, {features.cores} cores; {now}")
    for model_id in args.models.split(","):
        path = Path(resolve(model_id).path())
        spec = ModelSpec(model_id, str(path), lambda path=path: path)
        engine = Engine(spec, GGUFFile(path), EngineConfig(backend="torch", prefix_cache=False))
        fixture = json.loads((FIXTURES / f"{model_id}.json").read_text())
        prompts = [q["token_ids"] for q in fixture["prompts"][: args.prompts]]
        print(f"{model_id}: head {engine.model.output.kind}, {len(prompts)} prompts")
        batches = [int(b) for b in args.batches.split(",")]
        cost(engine, batches, args.steps)
        head_times(engine, batches, args.repeat)
        precision(engine, path, prompts)


if __name__ == "__main__":
    main()
