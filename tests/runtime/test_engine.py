"""The engine and its batch generator on tiny random models: what a caller of `generate`,
`Generator` and `embed` relies on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtime.engine import Engine, EngineConfig
from runtime.errors import ContextLengthError, EmptyPromptError, InvalidSamplingParams
from runtime.generator import TokenEvent
from runtime.models.base import BatchLayout, SequenceChunk
from runtime.sampling import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Engine:
    # the engine's logic on the exact backend: tiny random models have near-ties that bf16
    # outputs break arbitrarily (tests/runtime/test_kernels.py covers the torch backend)
    return Engine.load(str(tiny_model_path), EngineConfig(backend="numpy"))


def _prompt(engine: Engine, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, engine.model.vocab_size, n)]


def _run(engine: Engine, prompt: list[int], **params) -> list[TokenEvent]:
    return list(engine.generate(prompt, SamplingParams(**params)))


def _reference_greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens by full recompute of the whole sequence at every step (no cache reuse)."""
    tokens = list(prompt)
    for _ in range(n):
        cache = engine.model.new_cache(len(tokens))
        layout = BatchLayout([SequenceChunk(cache, 0, len(tokens))])
        hidden = engine.model.forward(np.asarray(tokens), layout)
        tokens.append(int(engine.model.logits(hidden[-1:])[0].argmax()))
    return tokens[len(prompt) :]


def test_greedy_generation_matches_full_recompute(engine):
    prompt = _prompt(engine, 7, seed=1)
    events = _run(engine, prompt, max_tokens=12, **GREEDY)
    assert [e.token_id for e in events] == _reference_greedy(engine, prompt, 12)
    assert [e.index for e in events] == list(range(12))
    assert [e.finish_reason for e in events] == [None] * 11 + ["length"]


def test_streamed_text_equals_decoded_tokens(engine):
    events = _run(engine, _prompt(engine, 5, seed=2), max_tokens=20, **GREEDY)
    streamed = "".join(e.text for e in events)
    assert streamed == engine.tokenizer.decode([e.token_id for e in events])


def test_batched_generation_equals_one_at_a_time(engine):
    prompts = [_prompt(engine, n, seed=n) for n in (3, 11, 6)]
    params = [
        SamplingParams(max_tokens=9, **GREEDY),
        SamplingParams(max_tokens=5, temperature=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=1.2, top_k=20, seed=3, ignore_eos=True),
    ]
    alone = [
        [e.token_id for e in engine.generate(p, sp)] for p, sp in zip(prompts, params, strict=True)
    ]
    generator = engine.new_generator()
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    generator.add("a", prompts[0], params[0])
    for event in generator.step():  # "b" and "c" join while "a" is already decoding
        got[event.request_id].append(event.token_id)
    generator.add("b", prompts[1], params[1])
    generator.add("c", prompts[2], params[2])
    while len(generator):
        for event in generator.step():
            got[event.request_id].append(event.token_id)
    assert [got["a"], got["b"], got["c"]] == alone


def test_chunked_prefill_gives_the_same_tokens(tiny_llama_path):
    prompt = list(range(20, 60))
    whole = Engine.load(str(tiny_llama_path))
    chunked = Engine.load(str(tiny_llama_path), EngineConfig(prefill_chunk=7))
    a = [e.token_id for e in _run(whole, prompt, max_tokens=6, **GREEDY)]
    b = [e.token_id for e in _run(chunked, prompt, max_tokens=6, **GREEDY)]
    assert a == b


def test_long_prompt_prefill_does_not_stall_a_running_stream(tiny_llama_path):
    engine = Engine.load(str(tiny_llama_path), EngineConfig(prefill_chunk=8))
    generator = engine.new_generator()
    generator.add("short", [20, 21, 22], SamplingParams(max_tokens=10, **GREEDY))
    generator.step()
    generator.add("long", list(range(20, 60)), SamplingParams(max_tokens=2, **GREEDY))
    produced = [{e.request_id for e in generator.step()} for _ in range(4)]
    assert all("short" in ids for ids in produced)  # one token per step while "long" prefills
    assert not any("long" in ids for ids in produced)  # 40 prompt tokens take 5 chunks of 8


def test_stop_string_truncates_and_finishes(engine):
    prompt = _prompt(engine, 6, seed=4)
    full = "".join(e.text for e in _run(engine, prompt, max_tokens=24, **GREEDY))
    stop = full[5:8]
    assert stop and full.index(stop) == 5
    events = _run(engine, prompt, max_tokens=24, stop=[stop], **GREEDY)
    assert "".join(e.text for e in events) == full[:5]
    assert events[-1].finish_reason == "stop"


def test_stop_token_id_ends_without_text(engine):
    prompt = _prompt(engine, 6, seed=5)
    tokens = [e.token_id for e in _run(engine, prompt, max_tokens=3, **GREEDY)]
    stop = tokens[1]
    events = _run(engine, prompt, max_tokens=10, stop_token_ids=[stop], **GREEDY)
    assert events[-1].token_id == stop and events[-1].finish_reason == "stop"
    assert len(events) == tokens.index(stop) + 1 and events[-1].text == ""


def test_abort_frees_the_sequence(engine):
    generator = engine.new_generator()
    generator.add("x", [20, 21], SamplingParams(max_tokens=50, **GREEDY))
    generator.step()
    assert generator.abort("x") and len(generator) == 0 and generator.step() == []
    assert not generator.abort("x")


def test_prompt_plus_max_tokens_beyond_context_is_rejected(engine):
    limit = engine.context_length
    with pytest.raises(ContextLengthError, match=f"maximum context length is {limit}"):
        list(engine.generate([20] * (limit - 5), SamplingParams(max_tokens=10)))
    list(engine.generate([20] * (limit - 10), SamplingParams(max_tokens=10, **GREEDY)))


def test_empty_prompt_is_rejected(engine):
    with pytest.raises(EmptyPromptError):
        list(engine.generate([], SamplingParams()))


def test_logit_bias_on_unknown_token_is_rejected(engine):
    with pytest.raises(InvalidSamplingParams):
        list(engine.generate([20], SamplingParams(logit_bias={10**6: 5.0})))


def test_seeded_sampling_is_reproducible(engine):
    prompt = _prompt(engine, 4, seed=6)
    params = dict(max_tokens=15, temperature=1.0, seed=1234, ignore_eos=True)
    first = [e.token_id for e in _run(engine, prompt, **params)]
    assert first == [e.token_id for e in _run(engine, prompt, **params)]
    other = [e.token_id for e in _run(engine, prompt, **{**params, "seed": 99})]
    assert other != first


def test_embeddings_are_mean_pooled_and_unit_length(engine):
    inputs = [_prompt(engine, 5, seed=7), _prompt(engine, 9, seed=8)]
    vectors = engine.embed(inputs)
    assert vectors.shape == (2, engine.model.embed.shape[1])
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    cache = engine.model.new_cache(5)
    hidden = engine.model.forward(np.asarray(inputs[0]), BatchLayout([SequenceChunk(cache, 0, 5)]))
    mean = hidden.mean(axis=0)
    np.testing.assert_allclose(vectors[0], mean / np.linalg.norm(mean), rtol=1e-4, atol=1e-6)
    assert not np.allclose(vectors[0], vectors[1])
    with pytest.raises(EmptyPromptError):
        engine.embed([[]])


def test_chat_prompt_uses_the_template(tiny_llama_path):
    engine = Engine.load(str(tiny_llama_path))
    ids = engine.encode_chat([{"role": "user", "content": "hi"}])
    text = engine.tokenizer.decode(ids, skip_special=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_prompt_logprobs_score_each_token_given_the_ones_before(engine):
    prompt = _prompt(engine, 9, seed=9)
    scored = engine.prompt_logprobs(prompt, top_n=3)
    assert len(scored) == len(prompt) and scored[0] == (None, [])
    logits = engine.model.logits(
        engine.model.forward(
            np.asarray(prompt), BatchLayout([SequenceChunk(engine.model.new_cache(9), 0, 9)])
        )
    ).astype(np.float64)
    logprobs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    for j in range(1, len(prompt)):
        value, top = scored[j]
        assert value == pytest.approx(logprobs[j - 1, prompt[j]], abs=1e-4)
        assert [t for t, _ in top] == list(np.argsort(-logprobs[j - 1])[:3])
