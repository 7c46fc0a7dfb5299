"""What the generator, KV pool and prefix cache tests share: token runs and a drain loop."""

from __future__ import annotations

import numpy as np

from runtime.generator import Generator
from runtime.sampling import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
TOL = dict(rtol=1e-4, atol=1e-4)


def random_tokens(n: int, seed: int, vocab: int = 250) -> list[int]:
    """`n` reproducible token ids, clear of the tiny models' special ids below 10."""
    return [int(t) for t in np.random.default_rng(seed).integers(10, vocab, n)]


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
