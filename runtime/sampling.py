"""Sampling: engine-side `SamplingParams`, per-sequence state, and a batch-aware sampler.

A decode step hands the sampler logits `[B, V]` for B sequences, each with its own
`SequenceSamplingState`. Each row gets its own `np.random.Generator`, so a sequence's tokens
never depend on which other sequences share its batch. Logits processors are small functions
over the sub-batch of rows that asked for them; an all-greedy batch is a single argmax.

Order of operations (vLLM's and llama.cpp's): logprobs from the raw logits, then logit_bias,
repetition penalty, presence/frequency penalties, temperature, top_k, top_p, min_p, draw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.constraints import Constraint
from runtime.errors import InvalidSamplingParams
from runtime.finish import FINISH_LENGTH, FINISH_STOP
from runtime.limits import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
)

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are treated as greedy; dividing by them only risks overflow."""


# ---------------------------------------------------------------- parameters


def _as_int(name: str, value: Any, param: str | None = None) -> int:
    # bool is an int subclass; True as a top_k or max_tokens is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidSamplingParams(
            f"{name} must be an integer, got {value!r}.", param=param or name
        )
    return int(value)


def _as_float(name: str, value: Any, param: str | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise InvalidSamplingParams(f"{name} must be a number, got {value!r}.", param=param or name)
    result = float(value)
    if not math.isfinite(result):
        raise InvalidSamplingParams(
            f"{name} must be a finite number, got {value!r}.", param=param or name
        )
    return result


def _as_token_id(name: str, value: Any, param: str | None = None) -> int:
    # JSON object keys are strings, so logit_bias arrives as {"123": 5}; accept digit strings.
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    token_id = _as_int(name, value, param)
    if token_id < 0:
        raise InvalidSamplingParams(
            f"{name} must be non-negative, got {token_id}.", param=param or name
        )
    return token_id


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, for one sequence.

    Normalised and validated in `__post_init__`: invalid values raise `InvalidSamplingParams`
    with a message naming the field and the value. Token ids are checked against the
    vocabulary later, by `check_vocab`, when a state is created for a model.

    - `temperature`: 0 means greedy (argmax).
    - `top_k`: 0 or -1 disables it. `top_p` in (0, 1]. `min_p` in [0, 1], relative to the
      most likely token's probability.
    - `repetition_penalty` (llama.cpp/HF): over tokens seen in prompt and output, positive
      logits are divided by it and negative ones multiplied.
    - `presence_penalty`, `frequency_penalty` (OpenAI, in [-2, 2]): over generated tokens,
      `logit -= frequency_penalty * count + presence_penalty * (count > 0)`.
    - `logit_bias`: token id -> value in [-100, 100], added to the logit.
    - `seed`: None draws fresh OS entropy; any int (negatives are taken modulo 2**64).
    - `stop`: a string or list of at most `MAX_STOP_STRINGS` non-empty strings of at most
      `MAX_STOP_STRING_CHARS` characters; normalised to a deduplicated list.
    - `logprobs`: None for none; 0..20 returns the chosen token's logprob plus that many top
      alternatives, all computed from the raw model logits (under a `constraint`, from the
      logits its grammar allows).
    - `marker_token_ids`: control tokens an answer's parser reads as text (a chat format's
      markers, `runtime.chat_formats`): one releases the start of a stop string held back
      before it, so text and marker reach the parser in the order they were generated; a
      stop string does not match across one (llama.cpp renders such tokens as text).
    - `constraint`: a `runtime.constraints.Constraint` (JSON object, JSON schema, regex,
      grammar) the output must match; the sequence ends with "stop" when it is complete.
      With `ignore_eos` the grammar decides when EOS may come.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    constraint: Constraint | None = None
    marker_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.max_tokens = _as_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise InvalidSamplingParams(
                f"max_tokens must be at least 1, got {self.max_tokens}.", param="max_tokens"
            )
        self.temperature = _as_float("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidSamplingParams(
                f"temperature must be non-negative, got {self.temperature}.", param="temperature"
            )
        self.top_p = _as_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams(
                f"top_p must be in (0, 1], got {self.top_p}.", param="top_p"
            )
        self.top_k = _as_int("top_k", self.top_k)
        if self.top_k < -1:
            raise InvalidSamplingParams(
                f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}.", param="top_k"
            )
        self.top_k = max(self.top_k, 0)
        self.min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParams(
                f"min_p must be in [0, 1], got {self.min_p}.", param="min_p"
            )
        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise InvalidSamplingParams(
                f"repetition_penalty must be greater than 0, got {self.repetition_penalty}.",
                param="repetition_penalty",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidSamplingParams(f"{name} must be in [-2, 2], got {value}.", param=name)
            setattr(self, name, value)
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.seed is not None:
            self.seed = _as_int("seed", self.seed)
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        self.marker_token_ids = self._normalise_stop_token_ids(
            self.marker_token_ids, "marker_token_ids"
        )
        if not isinstance(self.ignore_eos, bool | np.bool_):
            raise InvalidSamplingParams(
                f"ignore_eos must be a bool, got {self.ignore_eos!r}.", param="ignore_eos"
            )
        self.ignore_eos = bool(self.ignore_eos)
        if self.logprobs is not None:
            self.logprobs = _as_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise InvalidSamplingParams(
                    f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}.",
                    param="logprobs",
                )
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InvalidSamplingParams(
                f"constraint must be a runtime.constraints.Constraint, got {self.constraint!r}.",
                param="response_format",
            )

    @staticmethod
    def _normalise_logit_bias(bias: Any) -> dict[int, float]:
        if bias is None:
            return {}
        if not isinstance(bias, Mapping):
            raise InvalidSamplingParams(
                f"logit_bias must be a mapping of token id to bias, got {bias!r}.",
                param="logit_bias",
            )
        result: dict[int, float] = {}
        for key, value in bias.items():
            token_id = _as_token_id("logit_bias token id", key, "logit_bias")
            bias_value = _as_float(f"logit_bias[{token_id}]", value, "logit_bias")
            if not -MAX_LOGIT_BIAS <= bias_value <= MAX_LOGIT_BIAS:
                raise InvalidSamplingParams(
                    f"logit_bias[{token_id}] must be in [-100, 100], got {bias_value}.",
                    param="logit_bias",
                )
            result[token_id] = bias_value
        return result

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, Iterable):
            raise InvalidSamplingParams(
                f"stop must be a string or a list of strings, got {stop!r}.", param="stop"
            )
        result: list[str] = []
        for item in stop:
            if not isinstance(item, str):
                raise InvalidSamplingParams(
                    f"stop must contain only strings, got {item!r}.", param="stop"
                )
            if not item:
                raise InvalidSamplingParams("stop strings must be non-empty, got ''.", param="stop")
            if len(item) > MAX_STOP_STRING_CHARS:
                raise InvalidSamplingParams(
                    f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, "
                    f"got one of {len(item)}.",
                    param="stop",
                )
            if item not in result:
                result.append(item)
        if len(result) > MAX_STOP_STRINGS:
            raise InvalidSamplingParams(
                f"stop must have at most {MAX_STOP_STRINGS} strings, got {len(result)}.",
                param="stop",
            )
        return result

    @staticmethod
    def _normalise_stop_token_ids(ids: Any, name: str = "stop_token_ids") -> list[int]:
        if ids is None:
            return []
        if isinstance(ids, str | bytes) or not isinstance(ids, Iterable):
            raise InvalidSamplingParams(
                f"{name} must be a list of token ids, got {ids!r}.", param=name
            )
        return list(dict.fromkeys(_as_token_id(name, i) for i in ids))

    @property
    def greedy(self) -> bool:
        """Whether tokens are picked by argmax rather than drawn."""
        return self.temperature < GREEDY_TEMPERATURE

    def check_vocab(self, vocab_size: int) -> None:
        """Reject token ids that do not exist in a vocabulary of `vocab_size` tokens."""
        for name, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            for token_id in ids:
                if token_id >= vocab_size:
                    raise InvalidSamplingParams(
                        f"{name} token id {token_id} is out of range for a vocabulary of "
                        f"{vocab_size} tokens.",
                        param=name,
                    )


# ---------------------------------------------------------------- per-sequence state


@dataclass
class SampleResult:
    """One sampled token: its logprob and the top alternatives, all from the raw logits
    (logprob None where the sequence did not ask for logprobs)."""

    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


class SequenceSamplingState:
    """What the sampler needs to remember about one sequence between decode steps.

    Holds the row's random generator and, only when a penalty asks for them, dense per-token
    records of what was seen (prompt + output, for repetition_penalty) and how often each
    token was generated (output only, for presence/frequency). Dense arrays make
    `append` O(1) and the penalties one vectorised expression.
    """

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        prompt_token_ids: Sequence[int] = (),
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        params.check_vocab(vocab_size)
        self.params = params
        self.vocab_size = vocab_size
        # None asks the OS for entropy; negative seeds are folded into numpy's uint range.
        seed = None if params.seed is None else params.seed & 0xFFFF_FFFF_FFFF_FFFF
        self.generator = np.random.default_rng(seed)
        self.output_token_ids: list[int] = []
        self.finish_reason: str | None = None
        self._stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        )

        self.seen: np.ndarray | None = None  # [V] bool, prompt + output
        if params.repetition_penalty != 1.0:
            self.seen = np.zeros(vocab_size, dtype=bool)
            prompt = np.asarray(prompt_token_ids, dtype=np.int64)
            if prompt.size and (prompt.min() < 0 or prompt.max() >= vocab_size):
                raise ValueError(f"prompt_token_ids must be in [0, {vocab_size}).")
            self.seen[prompt] = True
        self.counts: np.ndarray | None = None  # [V] int32, output only
        if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
            self.counts = np.zeros(vocab_size, dtype=np.int32)
        self.bias_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64)
        self.bias_values = np.fromiter(params.logit_bias.values(), dtype=np.float64)

        # Flags the sampler reads per step; computed once.
        self.needs_processing = bool(
            self.bias_ids.size or self.seen is not None or self.counts is not None
        )
        self.plain_greedy = params.greedy and not self.needs_processing and not params.logprobs
        # whether anything past the argmax is used (a logprob, a draw, a penalty): such a
        # row's logits come from the head at the file's precision (runtime/kernels/heads.py)
        self.needs_full_logits = not self.plain_greedy or params.logprobs is not None

    def replay(self, token_ids: Sequence[int]) -> None:
        """Carry on after `token_ids` that an earlier run of this request sampled and sent
        (they are at the end of this state's prompt): the random stream is advanced by the
        one uniform each of those draws took, and presence/frequency counts include them, so a
        seeded request resumed on another worker samples what the uninterrupted run would."""
        if not self.params.greedy and token_ids:
            self.generator.random(len(token_ids))
        if self.counts is not None:
            np.add.at(self.counts, np.asarray(token_ids, dtype=np.int64), 1)

    def append(self, token_id: int) -> str | None:
        """Record a generated token; return "stop", "length" or None (keep going).

        "stop" means the token is in `stop_token_ids` or is EOS (unless `ignore_eos`);
        "length" means `max_tokens` tokens have now been generated. Stop strings are matched
        on text, by `runtime.stop_strings.StopStringMatcher`.
        """
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token_id must be in [0, {self.vocab_size}), got {token_id}.")
        self.output_token_ids.append(token_id)
        if self.seen is not None:
            self.seen[token_id] = True
        if self.counts is not None:
            self.counts[token_id] += 1
        if token_id in self._stop_ids:
            self.finish_reason = FINISH_STOP
        elif len(self.output_token_ids) >= self.params.max_tokens:
            self.finish_reason = FINISH_LENGTH
        return self.finish_reason


# ---------------------------------------------------------------- logits processors
# Each takes float64 logits [n, V] for the n rows that need it, and their states, and
# edits the logits in place. Masked-out tokens become -inf.


def apply_logit_bias(logits: np.ndarray, states: Sequence[SequenceSamplingState]) -> None:
    for row, state in zip(logits, states, strict=True):
        row[state.bias_ids] += state.bias_values


def apply_repetition_penalty(logits: np.ndarray, states: Sequence[SequenceSamplingState]) -> None:
    seen = np.stack([s.seen for s in states])  # [n, V]
    penalty = np.array([s.params.repetition_penalty for s in states])[:, None]  # [n, 1]
    penalised = np.where(logits > 0, logits / penalty, logits * penalty)  # [n, V]
    np.copyto(logits, penalised, where=seen)


def apply_presence_frequency(logits: np.ndarray, states: Sequence[SequenceSamplingState]) -> None:
    counts = np.stack([s.counts for s in states])  # [n, V]
    frequency = np.array([s.params.frequency_penalty for s in states])[:, None]  # [n, 1]
    presence = np.array([s.params.presence_penalty for s in states])[:, None]  # [n, 1]
    logits -= counts * frequency + (counts > 0) * presence


def apply_temperature(logits: np.ndarray, states: Sequence[SequenceSamplingState]) -> None:
    logits /= np.array([s.params.temperature for s in states])[:, None]


def apply_top_k(logits: np.ndarray, states: Sequence[SequenceSamplingState]) -> None:
    for row, state in zip(logits, states, strict=True):
        k = state.params.top_k
        row[np.argpartition(-row, k - 1)[k:]] = -np.inf  # exactly k survive, O(V)


def apply_top_p(logits: np.ndarray, states: Sequence[SequenceSamplingState]) -> None:
    for row, state in zip(logits, states, strict=True):
        probs = _softmax(row)
        order = _most_likely_covering(probs, state.params.top_p)
        sorted_probs = probs[order]
        mass_before = np.cumsum(sorted_probs) - sorted_probs
        # The nucleus: tokens whose preceding mass is still below top_p; never empty.
        keep = max(int(np.searchsorted(mass_before, state.params.top_p, side="left")), 1)
        nucleus = np.zeros(row.size, dtype=bool)
        nucleus[order[:keep]] = True
        row[~nucleus] = -np.inf


def _most_likely_covering(probs: np.ndarray, mass: float) -> np.ndarray:
    """Token ids, most likely first, of a prefix of the ranking holding at least `mass`.

    Sorting a whole 150k vocabulary per row is slow and the nucleus is usually a few
    hundred tokens, so sort a growing top slice until it holds enough probability.
    """
    k = 1024
    while k < probs.size:
        top = np.argpartition(-probs, k - 1)[:k]  # [k], unordered
        if probs[top].sum() >= mass:
            return top[np.argsort(-probs[top], kind="stable")]
        k *= 8
    return np.argsort(-probs, kind="stable")


def apply_min_p(logits: np.ndarray, states: Sequence[SequenceSamplingState]) -> None:
    # p_i < min_p * p_max  <=>  logit_i - logit_max < log(min_p), without a softmax.
    min_p = np.array([s.params.min_p for s in states])[:, None]  # [n, 1]
    threshold = logits.max(axis=1, keepdims=True) + np.log(min_p)  # [n, 1]
    logits[logits < threshold] = -np.inf


Processor = Callable[[np.ndarray, Sequence[SequenceSamplingState]], None]

# (applies to this state?, processor), in the order they run.
PENALTY_PROCESSORS: list[tuple[Callable[[SequenceSamplingState], bool], Processor]] = [
    (lambda s: s.bias_ids.size > 0, apply_logit_bias),
    (lambda s: s.seen is not None, apply_repetition_penalty),
    (lambda s: s.counts is not None, apply_presence_frequency),
]
# Only for rows that draw: these never change the argmax, so greedy rows skip them.
TRUNCATION_PROCESSORS: list[tuple[Callable[[SequenceSamplingState], bool], Processor]] = [
    (lambda s: s.params.temperature != 1.0, apply_temperature),
    (lambda s: 0 < s.params.top_k < s.vocab_size, apply_top_k),
    (lambda s: s.params.top_p < 1.0, apply_top_p),
    (lambda s: s.params.min_p > 0.0, apply_min_p),
]


# ---------------------------------------------------------------- sampler


def _softmax(row: np.ndarray) -> np.ndarray:
    probs = np.exp(row - row.max())  # [V]
    return probs / probs.sum()


def _log_normalizers(logits: np.ndarray) -> np.ndarray:
    """log(sum(exp(logits))) per row, in float64: [B, V] -> [B]."""
    # exp in the logits' own dtype is fast and exact enough; the sum needs float64.
    peak = logits.max(axis=1, keepdims=True)  # [B, 1]
    total = np.exp(logits - peak).sum(axis=1, dtype=np.float64)  # [B]
    return peak[:, 0].astype(np.float64) + np.log(total)


def _draw(row: np.ndarray, generator: np.random.Generator) -> int:
    """Inverse-CDF draw from softmax(row); one uniform per draw keeps streams aligned."""
    cdf = np.cumsum(np.exp(row - row.max()))  # [V]
    u = generator.random() * cdf[-1]
    token = int(np.searchsorted(cdf, u, side="right"))
    if token >= row.size:  # u rounded up onto the total; take the last token with mass
        token = int(np.flatnonzero(np.isfinite(row))[-1])
    return token


def _run(
    table: list[tuple[Callable[[SequenceSamplingState], bool], Processor]],
    logits: np.ndarray,
    states: Sequence[SequenceSamplingState],
) -> None:
    for applies, processor in table:
        rows = [j for j, s in enumerate(states) if applies(s)]
        if len(rows) == len(states):
            processor(logits, states)  # whole batch: no gather/scatter copies
        elif rows:
            sub = logits[rows]  # [n, V] copy
            processor(sub, [states[j] for j in rows])
            logits[rows] = sub


class Sampler:
    """Picks the next token for every row of a batch of logits.

    One sampler per model: it knows the vocabulary size (to validate token ids) and the EOS
    ids (to report `finish_reason`). It keeps no per-sequence data; that lives in the
    `SequenceSamplingState` objects passed to `sample`.
    """

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int] = ()) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be at least 1, got {vocab_size}.")
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)

    def new_state(
        self, params: SamplingParams, prompt_token_ids: Sequence[int] = ()
    ) -> SequenceSamplingState:
        """State for one new sequence; raises `InvalidSamplingParams` for unknown token ids."""
        return SequenceSamplingState(params, self.vocab_size, prompt_token_ids, self.eos_token_ids)

    def sample(
        self, logits: np.ndarray, states: Sequence[SequenceSamplingState]
    ) -> list[SampleResult]:
        """Pick one token per row of `logits` [B, V]; does not `append` it to the state."""
        if logits.ndim != 2 or logits.shape != (len(states), self.vocab_size):
            raise ValueError(
                f"logits must have shape [{len(states)}, {self.vocab_size}] (one row per "
                f"state), got {list(logits.shape)}."
            )
        if all(s.plain_greedy for s in states):
            tokens = logits.argmax(axis=1)  # [B]
        else:
            tokens = self._sample_rows(logits, states)
        # a logsumexp over the vocabulary costs as much as the argmax: only rows that
        # report logprobs pay for it
        scored = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        rows = logits if len(scored) == len(states) else logits[scored]
        normalizers = dict(zip(scored, _log_normalizers(rows), strict=True))
        results = []
        for i, state in enumerate(states):
            token = int(tokens[i])
            if i not in normalizers:
                results.append(SampleResult(token, None))
                continue
            logprob = float(logits[i, token]) - float(normalizers[i])
            top: list[tuple[int, float]] = []
            if state.params.logprobs:
                top = _top_logprobs(logits[i], normalizers[i], state.params.logprobs)
            results.append(SampleResult(token, logprob, top))
        return results

    def _sample_rows(
        self, logits: np.ndarray, states: Sequence[SequenceSamplingState]
    ) -> np.ndarray:
        tokens = logits.argmax(axis=1)  # [B]; right already for plain greedy rows
        rows = [i for i, s in enumerate(states) if not s.plain_greedy]
        work_states = [states[i] for i in rows]
        work = logits[rows].astype(np.float64)  # [n, V]
        _run(PENALTY_PROCESSORS, work, work_states)
        drawing = [j for j, s in enumerate(work_states) if not s.params.greedy]
        for j, state in enumerate(work_states):
            if state.params.greedy:
                tokens[rows[j]] = int(work[j].argmax())
        if drawing:
            draw_states = [work_states[j] for j in drawing]
            draw = work[drawing]  # [m, V]
            _run(TRUNCATION_PROCESSORS, draw, draw_states)
            for k, state in enumerate(draw_states):
                tokens[rows[drawing[k]]] = _draw(draw[k], state.generator)
        return tokens


def _top_logprobs(row: np.ndarray, normalizer: float, n: int) -> list[tuple[int, float]]:
    """The n most likely tokens of a logits row, most likely first (ties: lower id); tokens
    a grammar forbids (-inf) are never among them."""
    n = min(n, row.size)
    candidates = np.argpartition(-row, n - 1)[:n]  # [n], unordered
    ordered = sorted(candidates.tolist(), key=lambda t: (-float(row[t]), t))
    return [(t, float(row[t]) - float(normalizer)) for t in ordered if np.isfinite(row[t])]
