"""Qwen 3.5 (runtime/models/qwen35.py, runtime/models/delta_net.py) on the committed tiny
file made by llama.cpp's converter (tests/fixtures/arch/qwen35-F16.gguf: DeltaNet, full
attention, DeltaNet): its recurrent state is each sequence's own, so a row's logits are
bitwise the same alone and batched, whatever chunks its prompt came in; the engine runs it
without the prefix cache, and a preempted or resumed request gives the same tokens; what
it cannot run is refused by name. Agreement with llama.cpp: tests/runtime/test_architectures.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from runtime.engine import Engine, EngineConfig
from runtime.errors import ModelFormatError
from runtime.gguf_file import GGUFFile
from runtime.kernels import get_backend
from runtime.kernels.native import paged_attention
from runtime.kv_pool import BLOCK_SIZE
from runtime.models import ARCHITECTURES, load_model
from runtime.models.base import BatchLayout, SequenceChunk
from runtime.models.delta_net import RecurrentStateError
from runtime.sampling import SamplingParams
from tests.runtime.generation_helpers import GREEDY, run_all
from tests.runtime.test_row_invariance import _check, _sequences, _with_adapters

FIXTURE = Path(__file__).parents[1] / "fixtures/arch/qwen35-F16.gguf"


def _logits(model, tokens: np.ndarray, cuts: list[int]) -> np.ndarray:
    """One sequence's logits computed in passes ending at `cuts` (then the rest)."""
    cache, out, start = model.new_cache(len(tokens)), [], 0
    for end in [*cuts, len(tokens)]:
        layout = BatchLayout([SequenceChunk(cache, start, end - start)])
        out.append(model.logits(model.forward(tokens[start:end], layout)))
        start = end
    return np.concatenate(out)


def _tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 369, n)]


def test_registered_with_its_layers_as_the_file_says():
    assert "qwen35" in ARCHITECTURES
    model = load_model(GGUFFile(FIXTURE), get_backend("numpy"))
    assert [hasattr(layer, "delta_net") for layer in model.layers] == [True, False, True]
    assert model.recurrent
    # a DeltaNet layer keeps no KV of its own: a minimal stand-in in the pool
    assert [k.shape[0::2] for k in model.new_kv_pool(16).keys] == [(1, 1), (2, 16), (1, 1)]


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_chunked_prefill_gives_the_one_shot_logits(backend: str):
    """The conv's and the delta rule's state carry across passes: any cut, the same
    numbers; bitwise with the torch kernels (row-invariant products), within 1e-4 with
    numpy's (BLAS rounds a lone row's gemv unlike a batch's gemm)."""
    model = load_model(GGUFFile(FIXTURE), get_backend(backend))
    tokens = np.array(_tokens(40, seed=1))
    full = _logits(model, tokens, [])
    assert np.all(np.isfinite(full)) and full.std() > 0.1
    for cuts in ([7, 20, 21, 22], [1, 2, 3], [39]):
        got = _logits(model, tokens, cuts)
        if backend == "torch":
            assert np.array_equal(got, full), cuts
        np.testing.assert_allclose(got, full, rtol=0, atol=1e-4)


@pytest.mark.skipif(paged_attention() is None, reason="no C compiler")
def test_a_rows_logits_are_bitwise_the_same_alone_and_batched_with_lora(tmp_path: Path):
    """Each row's recurrence is its own (tests/runtime/test_row_invariance.py's check:
    prompts in two passes, then a decode step, beside 1 and 8 others)."""
    model, stacks = _with_adapters(FIXTURE, tmp_path)
    _check(model, _sequences(9, model.vocab_size, stacks), (2, 9))


def test_a_cache_with_tokens_but_no_state_is_refused():
    """A cache whose tokens came without their state (a prefix cache's blocks) is not
    computed from a zero state."""
    model = load_model(GGUFFile(FIXTURE), get_backend("numpy"))
    cache = model.new_cache(16)
    model.forward(np.array(_tokens(5, seed=2)), BatchLayout([SequenceChunk(cache, 0, 5)]))
    assert sorted(cache.recurrent) == [0, 2]
    cache.recurrent.clear()
    with pytest.raises(RecurrentStateError, match="layer 0's recurrent state"):
        model.forward(np.array([7]), BatchLayout([SequenceChunk(cache, 5, 1)]))


def test_the_tensor_forward_pass_is_refused_by_name():
    config = EngineConfig(backend="torch", device="cpu", torch_forward=True)
    with pytest.raises(ModelFormatError, match="qwen35's Gated DeltaNet layers run on the host"):
        Engine.load(str(FIXTURE), config)


def test_the_engine_runs_without_the_prefix_cache_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="runtime.engine"):
        engine = Engine.load(str(FIXTURE))
    assert engine.prefix_cache is None
    assert "no prefix cache" in caplog.text


def test_preempted_batched_and_resumed_requests_give_the_same_tokens():
    """A preempted sequence is recomputed from its tokens (its state rebuilt from zero);
    a resumed request continues where its first run stopped."""
    roomy = Engine.load(str(FIXTURE))
    requests = {
        f"r{i}": (_tokens(20 + 3 * i, seed=10 + i), SamplingParams(max_tokens=30, **GREEDY))
        for i in range(4)
    }
    alone = {rid: run_all(roomy.new_generator(), {rid: r})[rid] for rid, r in requests.items()}
    tight = Engine.load(str(FIXTURE))
    tight.kv_pool = tight.model.new_kv_pool(12 * BLOCK_SIZE)  # not four of ~55 tokens at once
    generator = tight.new_generator()
    got = run_all(generator, requests)
    assert generator.preemptions > 0
    for rid in requests:
        assert [e.token_id for e in got[rid]] == [e.token_id for e in alone[rid]], rid
    prompt, sent = requests["r1"][0], [e.token_id for e in alone["r1"][:5]]
    rest = SamplingParams(max_tokens=25, **GREEDY)
    resumed = run_all(roomy.new_generator(), {"r1": (prompt + sent, rest)}, r1={"resume": 5})
    assert [e.token_id for e in resumed["r1"]] == [e.token_id for e in alone["r1"][5:]]
