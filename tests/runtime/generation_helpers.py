"""What the generator, KV pool and prefix cache tests share: token runs and a drain loop."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from runtime.engine import Engine, EngineConfig
from runtime.generator import Generator
from runtime.gguf_file import GGUFFile
from runtime.kv_pool import BLOCK_SIZE
from runtime.prefix_cache import PrefixCache
from runtime.registry import ModelSpec
from runtime.sampling import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
TOL = dict(rtol=1e-4, atol=1e-4)


def random_tokens(n: int, seed: int, vocab: int = 250) -> list[int]:
    """`n` reproducible token ids, clear of the tiny models' special ids below 10."""
    return [int(t) for t in np.random.default_rng(seed).integers(10, vocab, n)]


def engine_tokens(engine: Engine, n: int, seed: int) -> list[int]:
    """`n` reproducible token ids from all of `engine`'s vocabulary but its first three."""
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, engine.tokenizer.vocab_size, n)]


def named_engine(model_id: str, path: Path, config: EngineConfig | None = None) -> Engine:
    """The engine of the GGUF file at `path` as the registry's `model_id` (the id its
    templates and limits are looked up by), the file given directly, not resolved."""
    spec = ModelSpec(model_id, str(path), lambda: path)
    return Engine(spec, GGUFFile(path), config)


def tight_engine(path: Path, n_blocks: int = 12, config: EngineConfig | None = None) -> Engine:
    """An engine whose KV pool holds only `n_blocks` blocks (12 = 192 tokens: too few for
    several sequences at once), so the generator must preempt."""
    engine = Engine.load(str(path), config)
    engine.kv_pool = engine.model.new_kv_pool(n_blocks * BLOCK_SIZE)
    engine.prefix_cache = PrefixCache(engine.kv_pool, "tight")
    return engine


def run_all(
    generator: Generator, requests: dict[str, tuple[list[int], SamplingParams]], **add
) -> dict:
    """Add every request (keyword arguments of `add` per request id in `add`), step until
    all finish; the events of each request, in order."""
    out: dict[str, list] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        generator.add(rid, prompt, params, **add.get(rid, {}))
    while len(generator):
        for event in generator.step():
            out[event.request_id].append(event)
    return out


def same_kernels():
    """fbgemm's fp16 for every weight (kernels/cpu.py `fp16_plan`): float32 activations,
    so two forward passes on it differ only by their own float32 code. Tests comparing the
    tensor path with the host path name it; this CPU's own plan may round activations to
    bf16 (AVX-512), where a last-bit difference grows to a bf16 step."""
    from runtime.kernels.cpu import cpu_features, fp16_plan

    return fp16_plan(cpu_features().cores)
