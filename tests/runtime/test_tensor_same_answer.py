"""Same request, same answer on the tensor path (what a GPU worker runs; here on the CPU,
uncaptured): a request's logits at every sampled position are the same alone, batched in
any bucket (beside rows long enough to widen its table window), after a prefix-cache hit
and resumed from its sent tokens, with overlapped steps (runtime/generator.py) on; one
resumed case is within 1e-5 only (the test says which).

The logits are read where the generator's runner samples them (runtime/device_steps.py:
`sample` for prefills and steps that wait, `sample_later` for overlapped ones). As in
test_decode_graphs.py, they must be bitwise equal on CUDA and on AVX-512 CPUs; below
AVX-512 torch's CPU kernels round a padded bucket's tail rows differently, so there they
agree to 1e-5 and in every token.
The `cuda` cases run the captured graphs on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.engine import Engine, EngineConfig
from runtime.sampling import SamplingParams
from tests.runtime.test_decode_graphs import DEVICES, _assert_same_logits

TOKENS = 12


@pytest.fixture
def models(long_models: dict[str, Path]) -> dict[str, Path]:
    return long_models  # tests/runtime/conftest.py


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    if request.param.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    return request.param


def _logits_of(
    engine: Engine, requests: list[tuple[str, list[int], SamplingParams, int]], cache: bool = False
):
    """Each request's tokens and the logits its sampled positions got, stepping together
    (`requests`: id, prompt, params, resume); `cache`: prompts go through the prefix cache."""
    generator = engine.new_generator()
    logits: dict[str, list[np.ndarray]] = {r[0]: [] for r in requests}
    tokens: dict[str, list[int]] = {r[0]: [] for r in requests}
    for name in ("sample", "sample_later"):
        original = getattr(generator.runner, name)

        def recording(device_logits, rows, original=original):
            host = device_logits.float().cpu().numpy()
            for values, row in zip(host, rows, strict=True):
                logits[row.request_id].append(values)
            return original(device_logits, rows)

        setattr(generator.runner, name, recording)
    for request_id, prompt, params, resume in requests:
        generator.add(request_id, prompt, params, cache_prompt=cache, resume=resume)
    while len(generator):
        for event in generator.step():
            tokens[event.request_id].append(event.token_id)
    return tokens, logits


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_logits_alone_batched_cached_and_resumed(models, device: str, arch: str):
    engine = Engine.load(
        str(models[arch]),
        EngineConfig(backend="torch", device=device, torch_forward=True, max_sequences=64),
    )
    rng = np.random.default_rng(3)
    probe = rng.integers(3, 250, 300).tolist()  # decodes in a table window of 512 alone
    alone_tokens, alone = _logits_of(engine, [("probe", probe, _greedy(TOKENS), 0)])
    assert len(alone["probe"]) == TOKENS
    expected = np.stack(alone["probe"])

    for mates in (1, 6, 13, 40):  # buckets 2, 8, 16 and 64, padding rows in each
        requests = [("probe", probe, _greedy(TOKENS), 0)]
        for i in range(mates):
            # one mate of 700 tokens widens every row's window to 1024 positions
            length = 700 if i == 3 else int(rng.integers(1, 90))
            prompt = rng.integers(3, 250, length).tolist()
            params = SamplingParams(max_tokens=int(rng.integers(4, 20)), seed=i)
            requests.append((f"mate{i}", prompt, params, 0))
        tokens, logits = _logits_of(engine, requests)
        assert tokens["probe"] == alone_tokens["probe"], f"beside {mates}"
        _assert_same_logits(np.stack(logits["probe"]), expected, device)

    # a prefix-cache hit (288 of the 300 prompt tokens): the cold run's logits
    _logits_of(engine, [("probe", probe, _greedy(1), 0)], cache=True)
    cached_tokens, cached = _logits_of(engine, [("probe", probe, _greedy(TOKENS), 0)], cache=True)
    assert cached_tokens["probe"] == alone_tokens["probe"]
    _assert_same_logits(np.stack(cached["probe"]), expected, device)

    # resumed after 5 sent tokens (prefilled now, decoded before): the rest of the run.
    # Bitwise for llama and for gemma3 with only windowed layers; with its global layer
    # (the sixth) the four positions after the resume still come out up to 7e-7 apart on
    # the CPU, for a reason not found yet (the layers' products and a decode row's
    # attention are row-invariant there: bench/log/2026-11-28-xeon-no-amx-overlap-lora-slots.md)
    sent = alone_tokens["probe"][:5]
    resumed_tokens, resumed = _logits_of(engine, [("probe", probe + sent, _greedy(TOKENS - 5), 5)])
    assert resumed_tokens["probe"] == alone_tokens["probe"][5:]
    if arch == "gemma3" and device == "cpu":
        np.testing.assert_allclose(np.stack(resumed["probe"]), expected[5:], rtol=0, atol=1e-5)
    else:
        _assert_same_logits(np.stack(resumed["probe"]), expected[5:], device)
