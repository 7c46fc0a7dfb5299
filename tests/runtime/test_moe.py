"""runtime/models/moe.py: the router's choice and weights as llama.cpp's build_moe_ffn makes
them (against float64 arithmetic written out here), experts kept in their file's type and
multiplied once per forward pass over the rows that chose them, a row's result the sum of
its own experts' products whatever shares its pass, and adapters refused on experts.
Agreement with llama.cpp on real conversions: tests/runtime/test_architectures.py (qwen3moe,
gpt-oss); row invariance through the engine: tests/runtime/test_tiny_archs.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtime.gguf_file import GGUFFile
from runtime.kernels import get_backend
from runtime.lora import AdapterError, load_adapter
from runtime.models import load_model
from runtime.models.base import BatchLayout, SequenceChunk
from runtime.models.moe import MoE, MoEArgs, route
from tests.runtime.arch_cases import ARCH_DIR
from tests.tiny_models import write_lora, write_tiny_arch

LOGITS = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32) * 3


def _softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _descending(scores: np.ndarray, k: int) -> np.ndarray:
    return np.array([sorted(range(len(r)), key=lambda i: (-r[i], i))[:k] for r in scores])


@pytest.mark.parametrize("gating", ["softmax", "sigmoid", "softmax_weight"])
@pytest.mark.parametrize("norm", [False, True])
def test_the_router_chooses_and_weighs_as_llama_cpp(gating: str, norm: bool):
    """softmax / sigmoid: the k most probable, weighed by their probabilities; softmax_weight
    (gpt-oss): the k largest logits, a softmax over those k; then the optional division by
    the k weights' sum and the scale, largest first."""
    args = MoEArgs(8, 3, gating=gating, norm_weights=norm, weights_scale=2.5)
    chosen, weights = route(LOGITS, args)
    probs = {"softmax": _softmax64(LOGITS), "sigmoid": 1 / (1 + np.exp(-LOGITS.astype(float)))}
    scores = probs.get(gating, LOGITS.astype(np.float64))
    want = _descending(scores, 3)
    np.testing.assert_array_equal(chosen, want)
    w = np.take_along_axis(scores, want, axis=1)
    if gating == "softmax_weight":
        w = _softmax64(w)
    if norm:
        w = w / w.sum(axis=1, keepdims=True)
    assert weights.dtype == np.float32
    np.testing.assert_allclose(weights, 2.5 * w, rtol=2e-6)


def test_ties_go_to_the_lower_expert_and_a_selection_bias_only_chooses():
    logits = np.zeros((1, 4), np.float32)
    chosen, weights = route(logits, MoEArgs(4, 2))
    assert chosen.tolist() == [[0, 1]]
    bias = np.array([0, 0, 1, 1], np.float32)  # DeepSeek's exp_probs_b: not in the weights
    chosen, weights = route(logits, MoEArgs(4, 2), selection_bias=bias)
    assert chosen.tolist() == [[2, 3]] and weights.tolist() == [[0.25, 0.25]]


def test_args_are_read_from_the_file_unless_the_arch_fixes_them(tmp_path: Path):
    f = GGUFFile(write_tiny_arch(tmp_path / "m.gguf", "qwen3moe"))
    assert MoEArgs.read(f) == MoEArgs(8, 3, "softmax", False, 1.0)
    assert MoEArgs.read(f, norm_weights=True).norm_weights
    with pytest.raises(ValueError, match="gating must be one of"):
        MoEArgs(8, 3, gating="softplus")
    with pytest.raises(ValueError, match="n_used must be in"):
        MoEArgs(8, 9)


class _Counting:
    """A weight that counts its calls and rows."""

    def __init__(self, weight, calls: list) -> None:
        self.weight, self.calls = weight, calls

    def __call__(self, x):
        self.calls.append(len(x))
        return self.weight(x)


def _moe_layers(model) -> list[MoE]:
    return [layer.moe for layer in model.layers]


def test_experts_keep_the_files_codes_and_each_multiplies_once_a_pass():
    """qwen3moe-Q8_0: each expert one int8 weight of the file's codes (as a dense Q8_0
    layer's) on the host path; a pass of 40 rows calls each expert at most once per layer,
    over k rows per row in all."""
    backend = get_backend("torch")
    if not backend.native_eight_bit:
        pytest.skip("Q8_0 codes need runtime/kernels/int8_rows.c (no C compiler here)")
    model = load_model(GGUFFile(ARCH_DIR / "qwen3moe-Q8_0.gguf"), backend)
    dense_kind = model.layers[0].wo.kind
    calls: list[list[int]] = []
    for moe in _moe_layers(model):
        assert {w.kind for w in moe.gate_up + moe.down} == {dense_kind}
        layer_calls: list[int] = []
        moe.gate_up = [_Counting(w, layer_calls) for w in moe.gate_up]
        calls.append(layer_calls)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, 40)
    model.forward(tokens, BatchLayout([SequenceChunk(model.new_cache(40), 0, 40)]))
    for layer_calls in calls:
        assert len(layer_calls) <= 4 and sum(layer_calls) == 40 * 2


def test_a_rows_output_is_its_own_experts_weighted_sum(tmp_path: Path):
    """A batch's MoE output, row by row, bitwise the row's k experts run on it alone and
    added in slot order (torch's kernels are row-invariant)."""
    model = load_model(GGUFFile(write_tiny_arch(tmp_path / "m.gguf", "qwen3moe")), get_backend())
    moe = model.layers[0].moe
    x = np.random.default_rng(1).standard_normal((23, 64)).astype(np.float32)
    xn = model.ops.rms_normalize(x, 1e-6)
    out = moe(xn)
    x_in = xn * moe.input_scale
    chosen, weights = route(np.einsum("td,ed->te", x_in, moe.router), moe.args)
    for t in range(len(x)):
        want = None
        for j, e in enumerate(chosen[t]):
            y = moe._expert(int(e), xn[t : t + 1])[0] * weights[t, j]
            want = y if want is None else want + y
        np.testing.assert_array_equal(out[t], want)


def test_an_adapter_on_experts_is_refused_by_name(tmp_path: Path):
    """LoRA adapts the attention (tests/runtime/test_tiny_archs.py), not the experts: they
    are not among the model's linear sources (nor, so, given LoRA slots on a device)."""
    path = write_tiny_arch(tmp_path / "m.gguf", "qwen3moe")
    model = load_model(GGUFFile(path), get_backend())
    assert model.linear_sources and not any("_exps" in n for n in model.linear_sources)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((4, 64)).astype(np.float32), np.zeros((32, 4), np.float32)
    lora = write_lora(tmp_path / "a.gguf", path, (), extra={"blk.0.ffn_up_exps.weight": (a, b)})
    with pytest.raises(AdapterError, match="'blk.0.ffn_up_exps.weight' is not a linear weight"):
        load_adapter("a", lora, model.linear_sources, model.architecture)


def test_an_adapter_on_attention_moves_a_moe_models_logits(tmp_path: Path):
    path = write_tiny_arch(tmp_path / "m.gguf", "qwen3moe")
    model = load_model(GGUFFile(path), get_backend())
    adapter = load_adapter(
        "a",
        write_lora(tmp_path / "a.gguf", path, ("attn_q", "attn_v")),
        model.linear_sources,
        model.architecture,
    )
    tokens = np.random.default_rng(2).integers(0, model.vocab_size, 12)

    def logits(stack: tuple) -> np.ndarray:
        layout = BatchLayout([SequenceChunk(model.new_cache(12), 0, 12, stack)])
        return model.logits(model.forward(tokens, layout))

    assert np.abs(logits(((adapter, 1.0),)) - logits(())).max() > 0.01
