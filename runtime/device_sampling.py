"""Sampling from logits that stay on the device: only token ids come back.

A tensor forward pass leaves its logits `[B, V]` on the device. Rows whose sampling needs
nothing from the host but one uniform - greedy, temperature, top_k, top_p, min_p, with or
without a seed - are sampled there, all rows at once, and only their token ids are copied
back. The result is the host sampler's (runtime/sampling.py), step for step: the same
processors in the same order on float64 values, and the same inverse-CDF draw in token id
order with one uniform from the row's own generator, so a seeded request samples the same
tokens on a GPU worker as on a CPU worker (up to floating-point ties).

Rows that need the whole distribution on the host (logit_bias, penalties, logprobs, a
grammar's mask) are copied back alone and go through the host sampler.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from runtime.sampling import SequenceSamplingState


def samples_on_device(state: SequenceSamplingState) -> bool:
    """Whether the row's token can be picked on the device (nothing but its RNG needed)."""
    return not state.needs_processing and state.params.logprobs is None


def sample_device_rows(
    logits: torch.Tensor, rows: Sequence[int], states: Sequence[SequenceSamplingState]
) -> list[int]:
    """Token ids for `rows` of `logits` `[B, V]` (each `samples_on_device`), `states` one
    per row of `rows`; one copy of the ids back to the host."""
    return device_row_tokens(logits, rows, states).cpu().tolist()


def device_row_tokens(
    logits: torch.Tensor, rows: Sequence[int], states: Sequence[SequenceSamplingState]
) -> torch.Tensor:
    """`sample_device_rows`'s token ids `[n]`, left on the device (nothing waits for them)."""
    picked = logits if len(rows) == logits.shape[0] else logits[list(rows)]  # [n, V]
    drawing = [i for i, s in enumerate(states) if not s.params.greedy]
    if len(drawing) == len(states):
        return _draw(picked, states)
    tokens = picked.argmax(dim=1)  # right already for greedy rows
    if drawing:
        index = _upload(np.asarray(drawing, np.int64), picked.device)
        tokens[index] = _draw(picked[index], [states[i] for i in drawing])
    return tokens


def _upload(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on `device` without waiting for the device: on a GPU through
    pinned memory (a pageable copy would wait for every step already queued, the step
    launched after this one's included)."""
    host = torch.from_numpy(values)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class PendingTokens:
    """A step's sampled token ids on their way to the host: the device tensor (the next
    step's inputs can be gathered from it without the host reading it) and, on a GPU, a
    copy into pinned memory started at once, whose event `host_ids` waits for; on the
    CPU the tensor itself."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens  # [n] int64 on the device
        self.copied: torch.cuda.Event | None = None
        if tokens.device.type == "cuda":
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()
        else:
            self.host = tokens

    def host_ids(self) -> list[int]:
        """The token ids, once the device has produced and copied them: the step's one
        wait for the device."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


def _draw(logits: torch.Tensor, states: Sequence[SequenceSamplingState]) -> torch.Tensor:
    """Temperature, top_k, top_p, min_p, then an inverse-CDF draw, per row `[m, V]`."""
    device, vocab = logits.device, logits.shape[1]
    temperature, top_k, top_p, min_p, uniforms = _row_settings(states, vocab, device)
    x = logits.double() / temperature  # [m, V]
    values, order = x.sort(dim=1, descending=True, stable=True)  # most likely first
    rank = torch.arange(vocab, device=device)[None, :]
    keep = rank < top_k  # [m, V] in sorted order
    probs = torch.softmax(values.masked_fill(~keep, -torch.inf), dim=1)
    mass_before = probs.cumsum(dim=1) - probs
    keep &= (mass_before < top_p) | (top_p >= 1.0) | (rank == 0)  # the nucleus, never empty
    keep &= (min_p <= 0.0) | (values >= values[:, :1] + torch.log(min_p.clamp_min(1e-300)))
    allowed = torch.zeros_like(keep).scatter_(1, order, keep)  # back to token id order
    weights = torch.exp(x - values[:, :1]).masked_fill(~allowed, 0.0)
    cdf = weights.cumsum(dim=1)  # [m, V]
    tokens = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True)[:, 0]
    last = (allowed * torch.arange(vocab, device=device)).argmax(dim=1)  # u rounded up
    return torch.where(tokens >= vocab, last, tokens)


def _row_settings(states: Sequence[SequenceSamplingState], vocab: int, device: torch.device):
    """Each row's temperature, top_k (vocab when off), top_p, min_p and its one uniform
    (drawn from the row's own generator), as `[m, 1]` columns: one upload per step."""
    rows = [
        (
            s.params.temperature,
            s.params.top_k if 0 < s.params.top_k < vocab else vocab,
            s.params.top_p,
            s.params.min_p,
            s.generator.random(),
        )
        for s in states
    ]
    table = _upload(np.asarray(rows, np.float64), device)  # [m, 5]
    return table.split(1, dim=1)
