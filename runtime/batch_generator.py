"""Step several sequences together: each `step` is one batched forward pass.

Sequences join with `add` and leave with `abort` or when they finish, between steps. A step
packs one token per decoding sequence plus prompt chunks of sequences still prefilling
(up to `prefill_chunk` prompt tokens per step, so a long prompt never stalls the others),
runs the model once, applies the LM head only to rows whose next token is wanted, samples,
and turns tokens into text events (incremental UTF-8-safe detokenizing, stop strings).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from runtime.errors import ContextLengthError, EmptyPromptError
from runtime.kv_cache import KVCache
from runtime.models.base import BatchLayout, SequenceChunk
from runtime.sampling import Sampler, SampleResult, SamplingParams, SequenceSamplingState
from runtime.stop_strings import StopStringMatcher
from runtime.tokenizer import IncrementalDetokenizer, Tokenizer

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = "stop", "length", "abort"


class CausalLM(Protocol):
    """What the generator needs of a model (see runtime/models/)."""

    context_length: int
    vocab_size: int

    def new_cache(self, max_tokens: int) -> KVCache: ...
    def forward(self, tokens: np.ndarray, layout: BatchLayout) -> np.ndarray: ...
    def logits(self, hidden: np.ndarray) -> np.ndarray: ...


@dataclass
class TokenEvent:
    """One generated token of one request, with the text it releases (may be empty)."""

    request_id: str
    index: int  # 0 for the first generated token
    token_id: int
    text: str
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class _Sequence:
    request_id: str
    prompt_ids: list[int]
    cache: KVCache
    sampling: SequenceSamplingState
    detokenizer: IncrementalDetokenizer
    stops: StopStringMatcher
    consumed: int = 0  # prompt tokens already in the cache
    next_token: int | None = None  # sampled, not yet fed to the model

    @property
    def prefilling(self) -> bool:
        return self.consumed < len(self.prompt_ids)


class BatchGenerator:
    """Continuous batching over one model: `add`, `step`, `abort`."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        sampler: Sampler,
        max_context: int | None = None,
        prefill_chunk: int = 512,
    ) -> None:
        self.model, self.tokenizer, self.sampler = model, tokenizer, sampler
        self.max_context = min(max_context or model.context_length, model.context_length)
        self.prefill_chunk = prefill_chunk
        self._sequences: dict[str, _Sequence] = {}

    def __len__(self) -> int:
        return len(self._sequences)

    @property
    def request_ids(self) -> list[str]:
        return list(self._sequences)

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise the error a request would get, without adding it."""
        if not prompt_ids:
            raise EmptyPromptError("the prompt is empty: it must contain at least one token")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_context:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_context} tokens, but "
                f"{total} were requested ({len(prompt_ids)} in the prompt, "
                f"{params.max_tokens} for the completion); shorten the prompt or max_tokens"
            )
        params.check_vocab(self.model.vocab_size)

    def add(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        if request_id in self._sequences:
            raise ValueError(f"request {request_id!r} is already running")
        self.check_request(prompt_ids, params)
        prompt = [int(t) for t in prompt_ids]
        self._sequences[request_id] = _Sequence(
            request_id=request_id,
            prompt_ids=prompt,
            cache=self.model.new_cache(len(prompt) + params.max_tokens),
            sampling=self.sampler.new_state(params, prompt),
            detokenizer=IncrementalDetokenizer(self.tokenizer),
            stops=StopStringMatcher(params.stop),
        )

    def abort(self, request_id: str) -> bool:
        """Drop a request now; its KV memory is freed. False if it was not running."""
        return self._sequences.pop(request_id, None) is not None

    def step(self) -> list[TokenEvent]:
        """One forward pass over every running sequence; the tokens it produced."""
        if not self._sequences:
            return []
        tokens, chunks, wanted = self._plan()
        hidden = self.model.forward(np.asarray(tokens, np.int64), BatchLayout(chunks))
        rows = [row for row, _ in wanted]
        logits = self.model.logits(hidden[rows])  # [B, V], LM head only where needed
        samples = self.sampler.sample(logits, [seq.sampling for _, seq in wanted])
        return [self._emit(seq, sample) for (_, seq), sample in zip(wanted, samples, strict=True)]

    def _plan(self) -> tuple[list[int], list[SequenceChunk], list[tuple[int, _Sequence]]]:
        """Tokens to feed, their per-sequence chunks, and (row, sequence) needing logits."""
        tokens: list[int] = []
        chunks: list[SequenceChunk] = []
        wanted: list[tuple[int, _Sequence]] = []
        budget = self.prefill_chunk
        for seq in self._sequences.values():
            if seq.prefilling:
                if budget <= 0:
                    continue
                piece = seq.prompt_ids[seq.consumed : seq.consumed + budget]
                budget -= len(piece)
                chunks.append(SequenceChunk(seq.cache, seq.consumed, len(piece)))
                seq.consumed += len(piece)
                tokens.extend(piece)
                if not seq.prefilling:
                    wanted.append((len(tokens) - 1, seq))
            else:
                chunks.append(SequenceChunk(seq.cache, seq.cache.length, 1))
                tokens.append(seq.next_token)
                wanted.append((len(tokens) - 1, seq))
        return tokens, chunks, wanted

    def _emit(self, seq: _Sequence, sample: SampleResult) -> TokenEvent:
        index = len(seq.sampling.output_token_ids)
        finish = seq.sampling.append(sample.token_id)
        # a stop token (EOS, end of turn, stop_token_ids) ends the text without adding to it
        delta = "" if finish == FINISH_STOP else seq.detokenizer.push(sample.token_id)
        text, hit_stop = seq.stops.push(delta)
        if hit_stop:
            finish = FINISH_STOP
        elif finish is not None:
            tail, hit_stop = seq.stops.push(seq.detokenizer.flush())
            text += tail if hit_stop else tail + seq.stops.flush()
        if finish is None:
            seq.next_token = sample.token_id
        else:
            del self._sequences[seq.request_id]
        return TokenEvent(
            seq.request_id,
            index,
            sample.token_id,
            text,
            sample.logprob,
            sample.top_logprobs,
            finish,
        )
