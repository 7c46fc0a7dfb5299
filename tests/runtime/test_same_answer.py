"""Same request, same answer (docs/contract.md): a greedy request gives the same tokens cold,
after a prefix-cache hit, batched among other requests, and resumed from its sent tokens;
on kernels whose rows do not depend on their batch, the same logits bit for bit.

Attention is runtime/kernels/paged_attention.c, where each row is computed alone in a fixed
order. The products are the plan's: every CPU's default plan (`row_invariant_plan`) is
row-invariant, while numpy's float32 BLAS (the numpy backend) rounds a row differently with
the rows beside it, by ~1e-4 in the logits (bench/invariance.py): there the tokens are
compared, not the bits. tests/runtime/test_row_invariance.py holds the bits in batches of up
to 64 with LoRA adapters, here and with the AVX2 plan forced.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.errors import ChatTemplateMissingError
from runtime.kernels.native import paged_attention
from runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Say hi.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
]
TOKENS = 8
PREFACE = "A conversation between a curious user and a helpful assistant who answers briefly."


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(engine, requests: list[tuple[list[int], int]], cache: bool):
    """(prompt, resume) requests in one generator, stepped together: each one's tokens and
    the logits its sampled positions got."""
    generator = engine.new_generator()
    tokens: dict[str, list[int]] = {}
    logits: dict[str, list[np.ndarray]] = {}
    sample = generator.runner.host_rows.sample  # the rows the sampler sees, per request

    def recording(host_logits, rows):
        for values, row in zip(host_logits, rows, strict=True):
            logits[row.request_id].append(np.array(values))
        return sample(host_logits, rows)

    generator.runner.host_rows.sample = recording
    for i, (prompt, resume) in enumerate(requests):
        generator.add(f"r{i}", prompt, greedy(TOKENS - resume), cache_prompt=cache, resume=resume)
        tokens[f"r{i}"], logits[f"r{i}"] = [], []
    while len(generator):
        for event in generator.step():
            tokens[event.request_id].append(event.token_id)
    ids = [f"r{i}" for i in range(len(requests))]
    return [tokens[r] for r in ids], [logits[r] for r in ids]


def encode(engine, text: str) -> list[int]:
    """A chat prompt where the model has a template, else (Gemma's GGUF has none) the same
    turn in plain text, long enough to fill a prefix-cache block."""
    try:
        return engine.encode_chat([{"role": "user", "content": text}])
    except ChatTemplateMissingError:
        return engine.encode(f"{PREFACE}\nUser: {text}\nAssistant:")


def conditions(engine):
    """The reference (each prompt cold and alone) and the same prompts after a prefix-cache
    hit, batched together and resumed from half their tokens: name -> (tokens, logits)."""
    prompts = [encode(engine, p) for p in PROMPTS]
    cold = [run(engine, [(p, 0)], cache=False) for p in prompts]
    reference = ([c[0][0] for c in cold], [c[1][0] for c in cold])
    cached: tuple[list, list] = ([], [])
    for p in prompts:
        run(engine, [(p, 0)], cache=True)  # writes the prompt's blocks to the prefix cache
        hits_before = engine.prefix_cache.stats.hits
        tokens, logits = run(engine, [(p, 0)], cache=True)
        assert engine.prefix_cache.stats.hits > hits_before, "the second run missed the cache"
        cached[0].append(tokens[0])
        cached[1].append(logits[0])
    half = TOKENS // 2
    sent = [(p, t[:half]) for p, t in zip(prompts, reference[0], strict=True)]
    r_tokens, r_logits = run(engine, [(p + t, half) for p, t in sent], cache=False)
    resumed = (
        [t + r for (_, t), r in zip(sent, r_tokens, strict=True)],
        [ref[:half] + r for ref, r in zip(reference[1], r_logits, strict=True)],
    )
    out = {
        "after a prefix-cache hit": cached,
        "batched": run(engine, [(p, 0) for p in prompts], cache=False),
        "resumed": resumed,
    }
    return reference, out


@pytest.mark.parametrize(
    "engine_name",
    ["smollm2_engine", "gemma3_engine", "smollm2_torch_engine", "gemma3_torch_engine"],
)
def test_greedy_tokens_are_the_same_cold_cached_batched_and_resumed(request, engine_name):
    engine = request.getfixturevalue(engine_name)
    reference, others = conditions(engine)
    assert all(len(tokens) == TOKENS for tokens in reference[0])
    for name, (tokens, _) in others.items():
        for prompt, got, want in zip(PROMPTS, tokens, reference[0], strict=True):
            assert got == want, f"{prompt!r} {name}: other tokens than cold and alone"


@pytest.mark.skipif(paged_attention() is None, reason="no C compiler: numpy attention")
@pytest.mark.parametrize("engine_name", ["smollm2_invariant_engine", "gemma3_invariant_engine"])
def test_row_invariant_kernels_give_bitwise_the_same_logits(request, engine_name):
    engine = request.getfixturevalue(engine_name)
    reference, others = conditions(engine)
    for name, (_, logits) in others.items():
        for prompt, got, want in zip(PROMPTS, logits, reference[1], strict=True):
            assert len(got) == len(want) == TOKENS
            for step, (a, b) in enumerate(zip(got, want, strict=True)):
                assert np.array_equal(a, b), (
                    f"{prompt!r} {name}: logits of token {step} differ by "
                    f"{np.abs(a - b).max():.3g} from cold and alone"
                )
