"""The tensor path's step runner (runtime/step_runners.py says what a runner is).

Logits stay on the device. Rows whose sampling needs only their random stream are sampled
there and only token ids come back (runtime/device_sampling.py); the other rows are copied
to the host and sampled as the host path samples them. With static decode steps
(runtime/decode_graphs.py), a step whose rows all decode one token runs as the bucket's
static step where one fits, and such a step can be launched from the previous step's
tokens while they are still on the device (`sample_later`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runtime.decode_graphs import Bucket, DecodeGraphs
from runtime.device_sampling import (
    PendingTokens,
    device_row_tokens,
    sample_device_rows,
    samples_on_device,
)
from runtime.models.base import SequenceChunk
from runtime.sampling import SampleResult
from runtime.step_runners import CausalLM, HostRows, StepRow


class DeviceSteps:
    """Device logits; static decode steps through `graphs` where the engine built them
    (None: every step eager)."""

    def __init__(self, model: CausalLM, host_rows: HostRows, graphs: DecodeGraphs | None) -> None:
        self.model, self.host_rows, self.graphs = model, host_rows, graphs

    def static_bucket(self, chunks: Sequence[SequenceChunk]) -> Bucket | None:
        return None if self.graphs is None else self.graphs.bucket_for(chunks)

    def run_static(
        self,
        tokens: Sequence[int],
        chunks: Sequence[SequenceChunk],
        bucket: Bucket,
        previous: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[n, V]` of a decode step in `bucket` (from `static_bucket`); with
        `previous`, `tokens` are row numbers into an earlier step's device tokens."""
        return self.graphs.run(tokens, chunks, bucket, previous=previous)

    def samples_on_device(self, row: StepRow) -> bool:
        """Whether the row's next token needs nothing from the host: no grammar mask, and
        a sampler that needs only the row's random stream."""
        return row.grammar is None and samples_on_device(row.sampling)

    def sample(self, logits: torch.Tensor, rows: Sequence[StepRow]) -> list[SampleResult]:
        """Rows that need only their RNG are sampled on the device and only token ids
        come back; the others' rows are copied to the host sampler."""
        on_device = [j for j, row in enumerate(rows) if self.samples_on_device(row)]
        results: list[SampleResult | None] = [None] * len(rows)
        if on_device:
            states = [rows[j].sampling for j in on_device]
            tokens = sample_device_rows(logits, on_device, states)
            for j, token in zip(on_device, tokens, strict=True):
                results[j] = SampleResult(token, None)
        on_host = [j for j in range(len(rows)) if results[j] is None]
        if on_host:
            host_logits = self.model.ops.to_host(logits[on_host])  # [n, V]
            samples = self.host_rows.sample(host_logits, [rows[j] for j in on_host])
            for j, sample in zip(on_host, samples, strict=True):
                results[j] = sample
        return results

    def sample_later(self, logits: torch.Tensor, rows: Sequence[StepRow]) -> PendingTokens:
        """Sample every row (each `samples_on_device`) on the device; the token ids start
        on their way back."""
        states = [row.sampling for row in rows]
        return PendingTokens(device_row_tokens(logits, range(len(rows)), states))
