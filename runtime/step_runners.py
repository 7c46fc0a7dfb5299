"""How a scheduled step becomes sampled tokens: chosen once, when a generator is built.

runtime/generator.py schedules a step (which sequences feed which tokens) and emits what
comes out; between the two, a runner runs the forward pass and samples the wanted rows.
The engine picks the runner for its path when it builds a generator, so no step asks
again which path it is on (an eager step, `eager_logits`, is the model's on either path):

- `HostSteps` (this module): numpy logits, every row through the host sampler.
- `DeviceSteps` (runtime/device_steps.py, torch): logits stay on the device; rows that
  need only their random stream are sampled there; a pure decode step runs as a static
  step (runtime/decode_graphs.py) where one fits (`static_bucket`, then `run_static`,
  vLLM's and SGLang's `can_run` / `replay`), and may be launched before the host has read
  the step before it (`sample_later`).

Both sample a host row the same way (`HostRows`): a constrained row's grammar mask, then
the sampler, so a request's tokens do not depend on the runner its engine chose.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from runtime.constraints import GrammarMatcher, apply_grammar_masks
from runtime.grammar_vocab import GrammarVocab
from runtime.models.base import BatchLayout, SequenceChunk
from runtime.sampling import Sampler, SampleResult, SequenceSamplingState


class CausalLM(Protocol):
    """What a runner needs of a model (see runtime/models/)."""

    context_length: int
    vocab_size: int

    ops: Any  # models/ops.py: host or tensor operations

    def forward(self, tokens: np.ndarray, layout: BatchLayout) -> np.ndarray: ...
    def logits(self, hidden: np.ndarray, exact: Sequence[bool] | None = None) -> np.ndarray: ...


@dataclass(frozen=True)
class StepRow:
    """What sampling needs of one wanted row: its sampler state and grammar matcher (and
    whose row it is, for whoever records a step's logits)."""

    request_id: str
    sampling: SequenceSamplingState
    grammar: GrammarMatcher | None

    @property
    def needs_full_logits(self) -> bool:
        """Whether the row's logits are seen or sampled from past their argmax (a logprob,
        a draw, a penalty, a grammar's mask): then they come from the head at the file's
        precision, where the plan's head is a cheaper copy (runtime/kernels/heads.py)."""
        return self.grammar is not None or self.sampling.needs_full_logits


class HostRows:
    """Samples rows on the host: grammar masks on the constrained rows, then the sampler.
    Keeps the time grammars cost (masks here, matcher updates by the generator)."""

    def __init__(self, sampler: Sampler, grammar_vocab: GrammarVocab) -> None:
        self.sampler, self.grammar_vocab = sampler, grammar_vocab
        self.grammar_seconds = 0.0  # masks + matcher updates, all steps
        self.grammar_rows = 0  # constrained rows masked, all steps

    def sample(self, logits: np.ndarray, rows: Sequence[StepRow]) -> list[SampleResult]:
        constrained = [j for j, row in enumerate(rows) if row.grammar is not None]
        if constrained:
            started = time.perf_counter()
            matchers = [rows[j].grammar for j in constrained]
            apply_grammar_masks(self.grammar_vocab, logits, constrained, matchers)
            self.grammar_seconds += time.perf_counter() - started
            self.grammar_rows += len(constrained)
        return self.sampler.sample(logits, [row.sampling for row in rows])


def eager_logits(
    model: CausalLM,
    tokens: Sequence[int],
    chunks: list[SequenceChunk],
    positions: list[int],
    rows: list[StepRow],
):
    """The model's forward pass over any step, then the head on the wanted rows (at
    `positions` of the step's tokens; those that need it at the file's precision marked);
    None when no row is wanted. Every runner's eager step: the model's ops keep the logits
    where its path keeps them (numpy on the host, a tensor on the device)."""
    hidden = model.forward(np.asarray(tokens, np.int64), BatchLayout(chunks))
    if not rows:
        return None
    exact = [row.needs_full_logits for row in rows]
    return model.logits(hidden[positions], exact)  # [B, V]


class HostSteps:
    """The host path: its logits are numpy arrays, every row sampled on the host; no
    static steps, so every step is eager and nothing is launched ahead."""

    def __init__(self, host_rows: HostRows) -> None:
        self.host_rows = host_rows

    def sample(self, logits: np.ndarray, rows: Sequence[StepRow]) -> list[SampleResult]:
        return self.host_rows.sample(logits, rows)

    def static_bucket(self, chunks: Sequence[SequenceChunk]) -> None:
        return None

    def run_static(self, tokens, chunks, bucket, previous=None):
        raise TypeError("the host path has no static steps: static_bucket is always None")

    def samples_on_device(self, row: StepRow) -> bool:
        return False

    def sample_later(self, logits, rows: Sequence[StepRow]):
        raise TypeError("the host path samples every row on the host")
