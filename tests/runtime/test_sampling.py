from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from runtime.errors import InvalidSamplingParams, LLMQRuntimeError
from runtime.sampling import (
    FINISH_LENGTH,
    FINISH_STOP,
    Sampler,
    SampleResult,
    SamplingParams,
    SequenceSamplingState,
    apply_presence_frequency,
    apply_repetition_penalty,
    apply_top_p,
)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def draws(logits: np.ndarray, n: int, **params: object) -> list[int]:
    """n tokens sampled from the same logits row by one seeded sequence."""
    row = np.asarray(logits, dtype=np.float32)
    sampler = Sampler(row.size)
    state = sampler.new_state(SamplingParams(seed=params.pop("seed", 0), **params))
    return [sampler.sample(row[None], [state])[0].token_id for _ in range(n)]


def random_logits(rows: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, size=(rows, vocab)).astype(np.float32)


# ---------------------------------------------------------------- greedy and temperature


def test_greedy_is_argmax_for_every_row() -> None:
    logits = random_logits(8, 50)
    sampler = Sampler(50)
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=3)):
        states = [sampler.new_state(params) for _ in range(8)]
        tokens = [r.token_id for r in sampler.sample(logits, states)]
        assert tokens == logits.argmax(axis=1).tolist()


def test_temperature_near_zero_approaches_greedy() -> None:
    logits = np.array([1.0, 1.3, 1.2, 0.9], dtype=np.float32)
    assert set(draws(logits, 300, temperature=1e-3)) == {1}
    assert len(set(draws(logits, 300, temperature=1.0))) > 1  # not greedy at 1


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(1, 30, seed=1)[0]
    assert set(draws(logits, 300, top_k=1, temperature=1.5)) == {int(logits.argmax())}


def test_top_k_never_leaves_the_top_k() -> None:
    logits = np.random.default_rng(2).normal(0, 0.5, size=20).astype(np.float32)
    top5 = set(np.argsort(-logits)[:5].tolist())
    seen = set(draws(logits, 2000, top_k=5))
    assert seen == top5  # nothing outside, and every member reachable


# ---------------------------------------------------------------- top_p and min_p


def test_top_p_keeps_exactly_the_nucleus() -> None:
    probs = np.array([0.06, 0.3, 0.04, 0.4, 0.2])
    logits = np.log(probs)
    # Mass before each token, most likely first: 0, .4, .7, .9, .96.
    assert set(draws(logits, 3000, top_p=0.75)) == {3, 1, 4}
    assert set(draws(logits, 3000, top_p=0.5)) == {3, 1}
    assert set(draws(logits, 500, top_p=0.35)) == {3}
    assert set(draws(logits, 3000, top_p=1.0)) == {0, 1, 2, 3, 4}


def test_top_p_processor_masks_everything_outside_the_nucleus() -> None:
    probs = np.array([0.06, 0.3, 0.04, 0.4, 0.2])
    row = np.log(probs)[None].copy()
    state = Sampler(5).new_state(SamplingParams(top_p=0.75))
    apply_top_p(row, [state])
    assert np.isneginf(row[0]).tolist() == [True, False, True, False, False]
    assert np.allclose(row[0, [1, 3, 4]], np.log(probs[[1, 3, 4]]))


@pytest.mark.parametrize(("scale", "top_p"), [(4.0, 0.9), (0.5, 0.5), (0.01, 0.95)])
def test_top_p_on_a_large_vocab_matches_a_full_sort(scale: float, top_p: float) -> None:
    # Nuclei from a few tokens to thousands, beyond the first partially sorted slice.
    logits = np.random.default_rng(5).normal(0, scale, size=(1, 20_000))
    probs = np.exp(log_softmax(logits[0]))
    order = np.argsort(-probs)
    keep = int(np.sum(np.cumsum(probs[order]) - probs[order] < top_p))
    state = Sampler(20_000).new_state(SamplingParams(top_p=top_p))
    apply_top_p(logits, [state])
    assert set(np.flatnonzero(np.isfinite(logits[0])).tolist()) == set(order[:keep].tolist())


def test_top_p_renormalises_within_the_nucleus() -> None:
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    counts = Counter(draws(logits, 8000, top_p=0.7))
    assert set(counts) == {0, 1}
    assert counts[0] / 8000 == pytest.approx(0.5 / 0.8, abs=0.02)


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    logits = np.log([0.05, 0.5, 0.1, 0.15, 0.2])
    # min_p * max = 0.125: keep 0.5, 0.15, 0.2; drop 0.1, 0.05.
    assert set(draws(logits, 3000, min_p=0.25)) == {1, 3, 4}
    assert set(draws(logits, 3000, min_p=0.0)) == {0, 1, 2, 3, 4}


# ---------------------------------------------------------------- penalties and bias


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    sampler = Sampler(5)
    state = sampler.new_state(SamplingParams(repetition_penalty=2.0), prompt_token_ids=[0, 1])
    state.append(3)
    row = np.array([[2.0, -1.0, 3.0, 0.5, -4.0]])
    apply_repetition_penalty(row, [state])
    assert row.tolist() == [[1.0, -2.0, 3.0, 0.25, -4.0]]  # 2 and 4 were never seen


def test_repetition_penalty_changes_greedy_choice() -> None:
    sampler = Sampler(3)
    logits = np.array([[3.0, 2.0, -1.0]], dtype=np.float32)
    plain = sampler.new_state(SamplingParams(temperature=0), prompt_token_ids=[0])
    penalised = sampler.new_state(
        SamplingParams(temperature=0, repetition_penalty=2.0), prompt_token_ids=[0]
    )
    assert sampler.sample(logits, [plain])[0].token_id == 0
    assert sampler.sample(logits, [penalised])[0].token_id == 1  # 3 / 2 < 2


def test_presence_and_frequency_penalties_follow_openai_formula() -> None:
    sampler = Sampler(4)
    params = SamplingParams(presence_penalty=0.3, frequency_penalty=0.5)
    state = sampler.new_state(params, prompt_token_ids=[0, 0, 3])  # prompt is not counted
    for token in (1, 1, 2):
        state.append(token)
    row = np.array([[1.0, 1.0, 1.0, 1.0]])
    apply_presence_frequency(row, [state])
    # logit - count * frequency - (count > 0) * presence
    assert row[0] == pytest.approx([1.0, 1.0 - 2 * 0.5 - 0.3, 1.0 - 0.5 - 0.3, 1.0])


def test_negative_presence_penalty_encourages_repeats() -> None:
    sampler = Sampler(2)
    state = sampler.new_state(SamplingParams(temperature=0, presence_penalty=-2.0))
    state.append(1)
    logits = np.array([[1.0, 0.0]], dtype=np.float32)
    assert sampler.sample(logits, [state])[0].token_id == 1


def test_logit_bias_minus_100_bans_and_plus_100_forces() -> None:
    logits = np.array([2.0, 1.0, 0.5, -3.0])
    assert set(draws(logits, 500, temperature=0, logit_bias={0: -100})) == {1}
    assert 0 not in draws(logits, 2000, logit_bias={0: -100})
    assert set(draws(logits, 500, logit_bias={3: 100})) == {3}


def test_logit_bias_accepts_string_keys_from_json() -> None:
    assert SamplingParams(logit_bias={"7": 5}).logit_bias == {7: 5.0}


# ---------------------------------------------------------------- seeds and batching


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    logits = np.zeros(1000)  # uniform: any difference in the generator shows up
    assert draws(logits, 50, seed=7) == draws(logits, 50, seed=7)
    assert draws(logits, 50, seed=7) != draws(logits, 50, seed=8)
    assert draws(logits, 50, seed=-1) == draws(logits, 50, seed=-1)


def test_no_seed_uses_fresh_entropy() -> None:
    sampler = Sampler(1000)
    row = np.zeros((1, 1000), dtype=np.float32)
    a, b = sampler.new_state(SamplingParams()), sampler.new_state(SamplingParams())
    seq_a = [sampler.sample(row, [a])[0].token_id for _ in range(20)]
    seq_b = [sampler.sample(row, [b])[0].token_id for _ in range(20)]
    assert seq_a != seq_b


BATCH_PARAMS = [
    SamplingParams(seed=1),
    SamplingParams(temperature=0),
    SamplingParams(seed=2, temperature=0.7, top_k=10, logprobs=2),
    SamplingParams(seed=3, top_p=0.8, min_p=0.05),
    SamplingParams(seed=4, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=1.0),
    SamplingParams(temperature=0, logit_bias={5: 3.0}, repetition_penalty=1.2),
    SamplingParams(seed=5, temperature=1.3, logit_bias={1: -100}, logprobs=5),
    SamplingParams(seed=6, top_k=3, top_p=0.9, temperature=0.5),
]


def decode(rows: list[int], steps: int) -> dict[int, list[SampleResult]]:
    """Run `rows` of BATCH_PARAMS together for `steps`, each row with its own logits stream."""
    vocab = 64
    sampler = Sampler(vocab)
    states = {i: sampler.new_state(BATCH_PARAMS[i], prompt_token_ids=[i, 2 * i]) for i in rows}
    out: dict[int, list[SampleResult]] = {i: [] for i in rows}
    for step in range(steps):
        logits = np.stack([random_logits(1, vocab, seed=100 * i + step)[0] for i in rows])
        for i, result in zip(rows, sampler.sample(logits, [states[i] for i in rows]), strict=True):
            states[i].append(result.token_id)
            out[i].append(result)
    return out


def test_row_result_is_identical_alone_or_in_a_batch_of_8() -> None:
    batched = decode(list(range(8)), steps=12)
    for i in range(8):
        assert decode([i], steps=12)[i] == batched[i]
    reordered = decode([7, 3, 0], steps=12)
    assert reordered[3] == batched[3] and reordered[0] == batched[0]


def test_empirical_distribution_matches_softmax() -> None:
    logits = np.array([1.0, 0.2, -0.5, 0.7, 0.0])
    n = 20_000
    for temperature in (1.0, 2.0):
        counts = Counter(draws(logits, n, temperature=temperature, seed=11))
        expected = n * np.exp(log_softmax(logits / temperature))
        chi2 = sum((counts[t] - e) ** 2 / e for t, e in enumerate(expected))
        assert chi2 < 18.47  # chi-square, 4 degrees of freedom, p = 0.001


# ---------------------------------------------------------------- logprobs


def test_logprobs_come_from_raw_logits_and_top_n_is_sorted() -> None:
    logits = random_logits(1, 2000, seed=3)
    expected = log_softmax(logits[0])
    sampler = Sampler(2000)
    # Penalties and temperature must not leak into the reported logprobs.
    params = SamplingParams(seed=0, temperature=0.3, logprobs=20, logit_bias={0: 10})
    result = sampler.sample(logits, [sampler.new_state(params, prompt_token_ids=[1])])[0]
    assert result.logprob == pytest.approx(expected[result.token_id], abs=1e-6)
    ids = [t for t, _ in result.top_logprobs]
    assert ids == np.argsort(-expected)[:20].tolist()
    values = [lp for _, lp in result.top_logprobs]
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(expected[ids].tolist(), abs=1e-6)


def test_logprobs_zero_returns_only_the_chosen_token_and_none_returns_nothing() -> None:
    logits = random_logits(2, 10, seed=4)
    sampler = Sampler(10)
    states = [sampler.new_state(SamplingParams(temperature=0, logprobs=n)) for n in (0, None)]
    with_zero, without = sampler.sample(logits, states)
    assert with_zero.top_logprobs == [] and without.top_logprobs == []
    assert with_zero.logprob == pytest.approx(log_softmax(logits[0]).max(), abs=1e-6)
    assert without.logprob is None  # not asked for: the logsumexp is skipped
    assert without.token_id == int(logits[1].argmax())


def test_logprobs_above_vocab_size_return_the_whole_vocab() -> None:
    sampler = Sampler(3)
    state = sampler.new_state(SamplingParams(logprobs=20, seed=0))
    result = sampler.sample(np.array([[0.0, 2.0, 1.0]], dtype=np.float32), [state])[0]
    assert [t for t, _ in result.top_logprobs] == [1, 2, 0]
    assert math.fsum(math.exp(lp) for _, lp in result.top_logprobs) == pytest.approx(1.0)


# ---------------------------------------------------------------- stop tokens and length


def test_append_reports_stop_tokens_eos_and_length() -> None:
    sampler = Sampler(10, eos_token_ids=[2])
    state = sampler.new_state(SamplingParams(max_tokens=3, stop_token_ids=[7]))
    assert state.append(5) is None
    assert state.append(7) == FINISH_STOP
    assert sampler.new_state(SamplingParams()).append(2) == FINISH_STOP
    ignoring = sampler.new_state(SamplingParams(max_tokens=2, ignore_eos=True))
    assert ignoring.append(2) is None
    assert ignoring.append(2) == FINISH_LENGTH
    assert ignoring.output_token_ids == [2, 2]


def test_append_rejects_token_outside_vocab() -> None:
    with pytest.raises(ValueError, match="token_id must be in"):
        Sampler(10).new_state(SamplingParams()).append(10)


def test_sample_rejects_logits_of_wrong_shape() -> None:
    sampler = Sampler(10)
    with pytest.raises(ValueError, match="logits must have shape"):
        sampler.sample(np.zeros((2, 10), np.float32), [sampler.new_state(SamplingParams())])


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0."),
        ({"max_tokens": -5}, "max_tokens must be at least 1, got -5."),
        ({"max_tokens": True}, "max_tokens must be an integer, got True."),
        ({"max_tokens": 3.0}, "max_tokens must be an integer, got 3.0."),
        ({"temperature": -0.1}, "temperature must be non-negative, got -0.1."),
        ({"temperature": float("nan")}, "temperature must be a finite number, got nan."),
        ({"temperature": "1"}, "temperature must be a number, got '1'."),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0.0."),
        ({"top_p": float("inf")}, "top_p must be a finite number, got inf."),
        ({"top_k": -2}, "top_k must be -1 or 0 (disabled) or at least 1, got -2."),
        ({"top_k": False}, "top_k must be an integer, got False."),
        ({"min_p": 1.01}, "min_p must be in [0, 1], got 1.01."),
        ({"repetition_penalty": 0}, "repetition_penalty must be greater than 0, got 0.0."),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5."),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2], got -3.0."),
        ({"logit_bias": {1: 101}}, "logit_bias[1] must be in [-100, 100], got 101.0."),
        ({"logit_bias": {-1: 1}}, "logit_bias token id must be non-negative, got -1."),
        ({"logit_bias": {"x": 1}}, "logit_bias token id must be an integer, got 'x'."),
        ({"logit_bias": [1, 2]}, "logit_bias must be a mapping of token id to bias, got [1, 2]."),
        ({"seed": 1.5}, "seed must be an integer, got 1.5."),
        ({"stop": ""}, "stop strings must be non-empty, got ''."),
        ({"stop": ["ok", 3]}, "stop must contain only strings, got 3."),
        ({"stop": [str(i) for i in range(5)]}, "stop must have at most 4 strings, got 5."),
        ({"stop": "x" * 1001}, "stop strings must be at most 1000 characters, got one of 1001."),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids must be non-negative, got -2."),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids, got 5."),
        ({"ignore_eos": 1}, "ignore_eos must be a bool, got 1."),
        ({"logprobs": 21}, "logprobs must be in [0, 20], got 21."),
        ({"logprobs": -1}, "logprobs must be in [0, 20], got -1."),
    ],
)
def test_invalid_params_name_field_and_value(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**kwargs)
    assert str(info.value) == message
    assert isinstance(info.value, LLMQRuntimeError) and isinstance(info.value, ValueError)


def test_token_ids_are_checked_against_the_vocab() -> None:
    sampler = Sampler(100)
    message = "logit_bias token id 100 is out of range for a vocabulary of 100 tokens."
    with pytest.raises(InvalidSamplingParams, match=message):
        sampler.new_state(SamplingParams(logit_bias={100: 1}))
    with pytest.raises(InvalidSamplingParams, match="stop_token_ids token id 250"):
        SequenceSamplingState(SamplingParams(stop_token_ids=[250]), vocab_size=100)


def test_params_are_normalised() -> None:
    params = SamplingParams(stop="###", top_k=-1, temperature=1, stop_token_ids=(3, 3, 4))
    assert params.stop == ["###"]
    assert params.top_k == 0
    assert isinstance(params.temperature, float)
    assert params.stop_token_ids == [3, 4]
    assert SamplingParams(stop=None, logit_bias=None).stop == []
    assert SamplingParams(stop=["a", "b", "a"]).stop == ["a", "b"]
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
