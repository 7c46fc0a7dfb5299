"""Where one batched decode step of our engine spends its time.

    python bench/step_profile.py [--model smollm2-135m-instruct] [--backend torch]
                                 [--sequences 1,4,32] [--prompt-tokens 32] [--steps 20]
                                 [--json-schema] [--loras K]

For each N: N sequences with their own random prompts are prefilled, then `--steps` decode
steps are timed, first plainly (the step time), then with the weight products and the
attention wrapped in timers (which adds a little overhead of its own). The table gives
milliseconds per step: each weight product by shape and kernel (int4, fp16, float32, ...:
the backend's weight objects are wrapped, so a product is timed with its conversions in and
out of the kernel's types, wherever the model calls it), attention (K/V store and the
attention itself), norms, rope, activations, sampling, and the rest (residual adds,
embedding, scheduling).

`--json-schema`: every sequence is constrained by a JSON schema (an array of at least 100
small objects, so none can finish during the profile); the table gains the grammar row
(llguidance's token masks of the batch in one parallel call, applying them, and the
matchers following the sampled tokens), and the last lines compare the tokens/s of N
constrained sequences with N unconstrained ones, two generators stepped in turn.

`--loras K`: K random rank-8 LoRA adapters (attn_q, attn_v, ffn_up, as the tests write them)
are loaded, and the last lines compare a decode step of N sequences spread over the K
adapters (sequence i uses adapter i mod K) with the same N sequences without adapters,
two generators stepped in turn (bench/RESULTS.md "Engine vs llama.cpp": at most 1.25x at N=32, K=4).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from runtime import models  # noqa: E402
from runtime.constraints import Constraint  # noqa: E402
from runtime.engine import Engine, EngineConfig  # noqa: E402
from runtime.kernels import BACKENDS  # noqa: E402
from runtime.models import attention, base  # noqa: E402
from runtime.models.ops import HostOps  # noqa: E402
from runtime.sampling import Sampler, SamplingParams  # noqa: E402


def timed(totals: dict[str, float], name_of: Callable[..., str], fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = fn(*args, **kwargs)
        totals[name_of(*args)] += time.perf_counter() - started
        return out

    return wrapper


class TimedWeight:
    """Stands in for a backend's weight object: times each product, passes the rest on."""

    def __init__(self, weight: Any, totals: dict[str, float], label: str) -> None:
        self.weight, self.totals, self.label = weight, totals, label

    def __call__(self, x: np.ndarray) -> np.ndarray:
        started = time.perf_counter()
        out = self.weight(x)
        self.totals[self.label] += time.perf_counter() - started
        return out

    def __getattr__(self, name: str) -> Any:  # shape, kind, nbytes; normed where it has it
        found = getattr(self.weight, name)
        if name != "normed":
            return found

        def normed(x: np.ndarray, eps: float) -> np.ndarray:  # the norm is the product's
            started = time.perf_counter()
            out = found(x, eps)
            self.totals[self.label] += time.perf_counter() - started
            return out

        return normed


WEIGHT_NAMES = ("wqkv", "wo", "w_gate_up", "w_down")
# runtime/models/ops.py HostOps names the functions the layers call, where they differ
HOST_OP_NAMES = {"attend_layout": "attend"}


def timed_weights(model: Any, totals: dict[str, float]) -> list[tuple[Any, str, Any]]:
    """Wrap every layer weight and the LM head in a `TimedWeight`; returns (owner, name,
    original) for each, to put back."""
    saved = []
    owners = [(layer, name) for layer in model.layers for name in WEIGHT_NAMES]
    for owner, name in [*owners, (model, "output")]:
        weight = getattr(owner, name)
        label = f"x @ W{list(weight.shape)}^T {weight.kind}"
        if owner is model:
            label = "logits " + label
        saved.append((owner, name, weight))
        setattr(owner, name, TimedWeight(weight, totals, label))
    return saved


LONG_JSON = Constraint(
    "json_schema",
    {
        "type": "array",
        "minItems": 100,
        "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            },
            "required": ["name", "age"],
        },
    },
)


def profile(
    engine: Engine, n: int, prompt_tokens: int, steps: int, constraint: Constraint | None = None
) -> dict[str, float]:
    rng = np.random.default_rng(n)
    params = SamplingParams(
        max_tokens=3 * steps + 8, temperature=0.0, ignore_eos=True, constraint=constraint
    )
    generator = engine.new_generator()
    for i in range(n):
        prompt = [int(t) for t in rng.integers(100, engine.model.vocab_size - 100, prompt_tokens)]
        generator.add(f"seq-{i}", prompt, params, cache_prompt=False)
    started: set[str] = set()
    while len(started) < n:
        started.update(e.request_id for e in generator.step())
    plain = []
    for _ in range(steps):
        t = time.perf_counter()
        generator.step()
        plain.append(time.perf_counter() - t)
    totals: dict[str, float] = defaultdict(float)
    patched = {
        (attention, "attend_layout"): lambda *a, **k: "attention",
        (base, "rms_normalize"): lambda *a: "norms",
        (base, "apply_rope"): lambda *a: "rope",
        (base, "silu_mul"): lambda *a: "activation",
        (base, "gelu_tanh_mul"): lambda *a: "activation",
        (Sampler, "sample"): lambda *a: "sampling",
    }
    saved = {}
    for (module, name), label in patched.items():
        saved[(module, name)] = getattr(module, name)
        wrapper = timed(totals, label, saved[(module, name)])
        setattr(module, name, wrapper)
        for arch in (models.llama, models.gemma3):  # modules that imported the names
            if hasattr(arch, name):
                setattr(arch, name, wrapper)
        if module is not Sampler:  # the host ops hold the functions the layers call
            setattr(HostOps, HOST_OP_NAMES.get(name, name), staticmethod(wrapper))
    weights = timed_weights(engine.model, totals)
    try:
        grammar_before = generator.grammar_seconds
        t = time.perf_counter()
        for _ in range(steps):
            generator.step()
        wrapped = time.perf_counter() - t
        totals["grammar (masks + matchers)"] = generator.grammar_seconds - grammar_before
    finally:
        for owner, name, weight in weights:
            setattr(owner, name, weight)
        for (module, name), fn in saved.items():
            setattr(module, name, fn)
            if module is not Sampler:
                setattr(HostOps, HOST_OP_NAMES.get(name, name), staticmethod(fn))
            for arch in (models.llama, models.gemma3):
                if hasattr(arch, name):
                    setattr(arch, name, fn)
    out = {name: seconds / steps for name, seconds in sorted(totals.items())}
    out["rest"] = wrapped / steps - sum(out.values())
    out["step (unwrapped, median)"] = float(np.median(plain))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--backend", choices=BACKENDS, default="torch", help="kernel backend")
    p.add_argument("--sequences", default="1,4,32")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json-schema", action="store_true", help="constrain every sequence")
    p.add_argument("--loras", type=int, default=0, help="compare steps with K adapters")
    args = p.parse_args(argv)
    engine = Engine.load(args.model, EngineConfig(backend=args.backend))
    ns = [int(n) for n in args.sequences.split(",")]
    constraint = LONG_JSON if args.json_schema else None
    results = {n: profile(engine, n, args.prompt_tokens, args.steps, constraint) for n in ns}
    rows = list(next(iter(results.values())))
    kernels = "; ".join(f"{k}: {v}" for k, v in engine.backend.describe().items())
    print(f"ms per decode step, {args.model}, {args.prompt_tokens}-token prompts")
    print(f"backend {engine.backend.name} ({kernels}); weights {engine.model.weight_kinds()}")
    width = max(map(len, rows)) + 2
    print(" " * width + "".join(f"{f'N={n}':>10s}" for n in ns))
    for row in rows:
        print(f"{row:{width}s}" + "".join(f"{results[n][row] * 1000:10.2f}" for n in ns))
    if constraint is not None:
        print("tokens/s under the JSON schema / unconstrained (steps alternating between them):")
        for n in ns:
            plain, constrained = _alternating_steps(engine, n, args.prompt_tokens, args.steps)
            ms = f"{plain * 1e3:.2f} / {constrained * 1e3:.2f} ms per step"
            print(f"  N={n}: {plain / constrained:.3f}x ({ms})")
    if args.loras:
        stacks = _load_adapters(engine, args.loras)
        print(f"step time with {args.loras} rank-8 LoRA adapters / without:")
        for n in ns:
            plain, adapted = _alternating_steps(
                engine, n, args.prompt_tokens, args.steps, None, stacks
            )
            ms = f"{adapted * 1e3:.2f} / {plain * 1e3:.2f} ms per step"
            print(f"  N={n}: {adapted / plain:.3f}x ({ms})")
    return 0


def _load_adapters(engine: Engine, k: int) -> list[Any]:
    """K random adapters for the engine's model, one stack (adapter, scale 1) each."""
    from tests.tiny_models import write_lora  # the tests' adapter writer (gguf's writer)

    with tempfile.TemporaryDirectory() as folder:
        model = engine.spec.path()
        paths = [write_lora(Path(folder) / f"a{j}.gguf", model, seed=j) for j in range(k)]
        return [((engine.load_adapter(f"bench-{j}", path), 1.0),) for j, path in enumerate(paths)]


def _alternating_steps(
    engine: Engine,
    n: int,
    prompt_tokens: int,
    steps: int,
    constraint: Constraint | None = LONG_JSON,
    stacks: list[Any] | None = None,
) -> tuple[float, float]:
    """Median decode step (s) of N plain sequences and of N constrained by `constraint`
    (and/or spread over the adapter `stacks`), two generators stepped in turn so that a
    noisy spell of the machine hits both."""
    generators = []
    for variant in (False, True):
        rng = np.random.default_rng(n)
        params = SamplingParams(
            max_tokens=3 * steps + 8,
            temperature=0.0,
            ignore_eos=True,
            constraint=constraint if variant else None,
        )
        generator = engine.new_generator()
        for i in range(n):
            prompt = [
                int(t) for t in rng.integers(100, engine.model.vocab_size - 100, prompt_tokens)
            ]
            adapters = stacks[i % len(stacks)] if variant and stacks else ()
            generator.add(f"seq-{i}", prompt, params, cache_prompt=False, adapters=adapters)
        started: set[str] = set()
        while len(started) < n:
            started.update(e.request_id for e in generator.step())
        generators.append(generator)
    times: list[list[float]] = [[], []]
    for step in range(2 * steps):
        for k in (0, 1) if step % 2 else (1, 0):
            t = time.perf_counter()
            generators[k].step()
            times[k].append(time.perf_counter() - t)
    return float(np.median(times[0])), float(np.median(times[1]))


if __name__ == "__main__":
    sys.exit(main())
