"""Same request, same answer (docs/contract.md): a greedy request gives the same tokens cold,
after a prefix-cache hit, batched among other requests, and resumed from its sent tokens.

On the real models, both backends, this CPU's kernel plan. Where the plan rounds
activations to bf16 (int4 / int8 / bf16 products: the AVX-512 plans), last-bit float32
differences between those conditions become bf16 steps and flip near-ties ("Say hi."
answered "I'm here to help..." cold and "Hello there!..." cached on an AVX-512 Xeon); the
cause is attention, whose sums depend on the batch and the pool's block layout
(bench/invariance.py measures it; bench/RESULTS.md "Same request, same answer"). There the
test is an expected failure until attention is row-invariant.
"""

from __future__ import annotations

import pytest

from runtime.errors import ChatTemplateMissingError
from runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "Say hi.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
]
TOKENS = 10
PREFACE = "A conversation between a curious user and a helpful assistant who answers briefly."
BF16_ACTIVATIONS = {"int4", "int8", "bf16"}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(engine, requests: list[tuple[list[int], int]], cache: bool) -> list[list[int]]:
    """(prompt, resume) requests in one generator, stepped together: each one's tokens."""
    generator = engine.new_generator()
    out: dict[str, list[int]] = {}
    for i, (prompt, resume) in enumerate(requests):
        generator.add(f"r{i}", prompt, greedy(TOKENS - resume), cache_prompt=cache, resume=resume)
        out[f"r{i}"] = []
    while len(generator):
        for event in generator.step():
            out[event.request_id].append(event.token_id)
    return [out[f"r{i}"] for i in range(len(requests))]


def encode(engine, text: str) -> list[int]:
    """A chat prompt where the model has a template, else (Gemma's GGUF has none) the same
    turn in plain text, long enough to fill a prefix-cache block."""
    try:
        return engine.encode_chat([{"role": "user", "content": text}])
    except ChatTemplateMissingError:
        return engine.encode(f"{PREFACE}\nUser: {text}\nAssistant:")


@pytest.fixture(
    params=["smollm2_engine", "gemma3_engine", "smollm2_torch_engine", "gemma3_torch_engine"]
)
def engine(request):
    engine = request.getfixturevalue(request.param)
    kinds = set(engine.model.weight_kinds())
    if engine.backend.name == "torch" and kinds & BF16_ACTIVATIONS:
        request.applymarker(
            pytest.mark.xfail(
                reason=f"this CPU's plan ({sorted(kinds)}) rounds activations to bf16 and "
                "attention is not yet row-invariant",
                strict=False,
            )
        )
    return engine


def test_greedy_tokens_are_the_same_cold_cached_batched_and_resumed(engine):
    prompts = [encode(engine, p) for p in PROMPTS]
    cold = [run(engine, [(p, 0)], cache=False)[0] for p in prompts]
    assert all(len(tokens) == TOKENS for tokens in cold)

    cached = []
    for p in prompts:
        run(engine, [(p, 0)], cache=True)  # writes the prompt's blocks to the prefix cache
        hits_before = engine.prefix_cache.stats.hits
        cached.append(run(engine, [(p, 0)], cache=True)[0])
        assert engine.prefix_cache.stats.hits > hits_before, "the second run did not hit the cache"
    batched = run(engine, [(p, 0) for p in prompts], cache=False)
    half = TOKENS // 2
    sent = [(p + c[:half], half) for p, c in zip(prompts, cold, strict=True)]
    resumed = run(engine, sent, cache=False)

    for i, prompt in enumerate(PROMPTS):
        assert cached[i] == cold[i], f"{prompt!r}: a prefix-cache hit changed the answer"
        assert batched[i] == cold[i], f"{prompt!r}: sharing the batch changed the answer"
        assert cold[i][:half] + resumed[i] == cold[i], f"{prompt!r}: resuming changed it"
