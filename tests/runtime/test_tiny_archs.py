"""The architectures beyond llama and gemma3 (runtime/models/<arch>.py over layers.py): each
tiny model (tests/tiny_models.py `write_tiny_arch`) loads; on the host path a row's logits
are bitwise the same alone and batched, with LoRA stacks; the tensor path equals the host
path, agrees alone, batched, cached and resumed, and its static decode step (what a GPU
captures) gives the eager logits. Against real references (slow): llama.cpp's own
converter on a transformers model with random weights, then transformers' float32 logits
and llama.cpp's (llama-cpp-python) on that file (tests/hf_reference.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from runtime.engine import Engine, EngineConfig
from runtime.errors import ModelFormatError
from runtime.gguf_file import GGUFFile
from runtime.kernels import get_backend
from runtime.kernels.native import paged_attention
from runtime.models import ARCHITECTURES, load_model
from runtime.models.base import BatchLayout, SequenceChunk
from tests import hf_reference
from tests.runtime.generation_helpers import same_kernels
from tests.runtime.test_decode_graphs import _assert_same_logits as _assert_same_cpu_logits
from tests.runtime.test_decode_graphs import _side_by_side
from tests.runtime.test_row_invariance import _check, _sequences, _with_adapters
from tests.runtime.test_tensor_same_answer import _greedy, _logits_of
from tests.tiny_models import TINY_ARCHS, TinyShape, write_tiny_arch, write_tiny_gemma4

ARCHS = sorted(TINY_ARCHS)


@pytest.fixture(scope="module", params=ARCHS)
def arch_path(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_arch(tmp_path_factory.mktemp("arch") / f"{request.param}.gguf", request.param)


def _logits(model, tokens: np.ndarray, cuts: list[int]) -> np.ndarray:
    """One sequence's logits computed in passes ending at `cuts` (then the rest)."""
    cache, out, start = model.new_cache(len(tokens)), [], 0
    for end in [*cuts, len(tokens)]:
        layout = BatchLayout([SequenceChunk(cache, start, end - start)])
        out.append(model.ops.to_host(model.logits(model.forward(tokens[start:end], layout))))
        start = end
    return np.concatenate(out)


def test_every_tiny_architecture_is_registered():
    assert set(TINY_ARCHS) <= set(ARCHITECTURES)


def test_each_layer_gets_its_window_and_rope(tmp_path: Path):
    """As llama.cpp places them: OLMo 3's window on three layers of four, gpt-oss's on even
    layers (its sinks and output bias in every layer), SmolLM3 without rope in every fourth
    layer."""
    olmo = load_model(GGUFFile(write_tiny_arch(tmp_path / "o.gguf", "olmo2")), get_backend())
    assert olmo.kv_windows == [8, 8, 8, None]
    oss = load_model(GGUFFile(write_tiny_arch(tmp_path / "g.gguf", "gpt-oss")), get_backend())
    assert oss.kv_windows == [8, None, 8, None]
    assert all(b.sinks is not None and b.out_bias is not None for b in oss.layers)
    smol = load_model(GGUFFile(write_tiny_arch(tmp_path / "s.gguf", "smollm3")), get_backend())
    assert [layer.rope_key for layer in smol.layers] == ["global"] * 3 + [None]


def test_mistral3s_moe_layers_are_refused_at_load(tmp_path: Path):
    f = GGUFFile(write_tiny_arch(tmp_path / "m.gguf", "mistral3"))
    load_model(f, get_backend("numpy"))
    f._tensors["blk.0.ffn_gate_inp.weight"] = f._tensors["blk.0.ffn_up.weight"]
    with pytest.raises(ModelFormatError, match="mistral3 with MoE layers is not supported"):
        load_model(f, get_backend("numpy"))


def test_gemma4s_layers_keep_their_own_head_size_kv_heads_rope_and_kv(tmp_path: Path):
    """As llama.cpp's gemma4.cpp reads them: the full layers' head size, KV heads, v from
    k, rope key; the last two layers read the keys and values of the two before them
    (llama.cpp's layer_reuse_cb), which the KV pool keeps once."""
    model = load_model(GGUFFile(write_tiny_arch(tmp_path / "g.gguf", "gemma4")), get_backend())
    shapes = [(b.args.head_dim, b.args.n_kv_heads, b.rope_key, b.kv_source) for b in model.layers]
    assert shapes == [(16, 2, "local", 0), (32, 1, "global", 1), (16, 2, "local", 0)] + [
        (32, 1, "global", 1)
    ]
    assert [b.k_eq_v for b in model.layers[:2]] == [False, True]
    assert model.kv_windows == [8, None, 8, None] and model.kv_shape == (4, 2, 32)
    pool = model.new_kv_pool(16)
    assert [k.shape for k in pool.keys[:2]] == [(2, 16, 16), (1, 16, 32)]
    assert pool.keys[2] is pool.keys[0] and pool.values[3] is pool.values[1]
    assert pool.block_nbytes == 2 * (2 * 16 + 32) * 16 * pool.value_bytes


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="needs llama_cpp")
def test_the_tiny_gemma4_in_float32_is_llama_cpps(tmp_path: Path):
    """llama.cpp itself on the tiny gemma4 with float32 weights (it rounds no activation to
    fp16 or int8 then): full layers with v from k and one KV head between sliding layers of
    another head size, output scales, the final softcap, per-layer embeddings, the last two
    layers on the KV of the two before, experts beside each FFN; a prompt in chunks, then
    decode steps. Measured 6.1e-3 at most, 4.1e-3 with ggml's float16 GELU table emulated
    (llama.cpp's CPU GELU reads it; gemma2's 1.9e-3; the unscaled q.k magnifies it);
    without the per-layer embeddings 4.9, the experts 3.8, their output scales 1.3."""
    path = write_tiny_gemma4(tmp_path / "g.gguf", float32=True)
    tokens = np.random.default_rng(1).integers(3, 250, 60)
    model = load_model(GGUFFile(path), get_backend("numpy"))
    got = _logits(model, tokens, [40, 57, 58, 59])
    np.testing.assert_allclose(got, _llama_cpp_logits(path, tokens), rtol=0, atol=0.02)


def test_loads_and_caching_or_chunking_keeps_the_numbers(arch_path: Path):
    model = load_model(GGUFFile(arch_path), get_backend("numpy"))
    assert model.architecture == arch_path.stem
    assert all(name.startswith(("blk.", "output")) for name in model.linear_sources)
    tokens = np.random.default_rng(1).integers(0, model.vocab_size, 40)
    full = _logits(model, tokens, [])
    assert np.all(np.isfinite(full)) and full.std() > 0.1
    np.testing.assert_allclose(_logits(model, tokens, [7, 20, 21, 22]), full, rtol=0, atol=1e-4)


@pytest.mark.skipif(paged_attention() is None, reason="no C compiler")
def test_a_rows_logits_are_bitwise_the_same_alone_and_batched_with_lora(arch_path, tmp_path):
    model, stacks = _with_adapters(arch_path, tmp_path)
    _check(model, _sequences(9, model.vocab_size, stacks), (2, 9))


def test_the_tensor_path_equals_the_host_path(arch_path: Path):
    """On the CPU both multiply with the same fp16 kernels (`same_kernels`): they differ
    only in the forward pass's own float32 code (tests/runtime/test_tensor_forward.py)."""
    prompts = [np.random.default_rng(n).integers(0, 250, n) for n in (5, 31, 12)]
    want, got = [], []
    for tensor, out in ((False, want), (True, got)):
        config = EngineConfig(
            backend="torch", device="cpu", torch_forward=tensor, kernels=same_kernels()
        )
        engine = Engine.load(str(arch_path), config)
        out.extend(_logits(engine.model, p, [len(p) - 2, len(p) - 1]) for p in prompts)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)


def _assert_same_logits(got: np.ndarray, want: np.ndarray) -> None:
    """Bitwise on AVX-512 CPUs, else within ROUNDING_BELOW_AVX512 and in every greedy token
    (test_decode_graphs.py): at 4025c02 (attention's products row-invariant) every tiny
    architecture, qwen3moe's experts too, came out bitwise on an AVX-512 Xeon guest."""
    _assert_same_cpu_logits(got, want, "cpu")


def test_tensor_path_logits_alone_batched_cached_and_resumed(tmp_path: Path):
    """As test_tensor_same_answer.py, on a shorter probe, for every tiny architecture (a
    MoE's rows choose among its experts: a row's experts multiply it beside other rows)."""
    for arch in ARCHS:
        path = write_tiny_arch(tmp_path / f"{arch}.gguf", arch, TinyShape(n_layers=4))
        engine = Engine.load(
            str(path),
            EngineConfig(backend="torch", device="cpu", torch_forward=True, max_sequences=16),
        )
        rng = np.random.default_rng(3)
        probe = rng.integers(3, 250, 60).tolist()
        alone_tokens, alone = _logits_of(engine, [("probe", probe, _greedy(8), 0)])
        expected = np.stack(alone["probe"])
        mates = [
            (f"m{i}", rng.integers(3, 250, 5 + 11 * i).tolist(), _greedy(6), 0) for i in range(6)
        ]
        tokens, logits = _logits_of(engine, [("probe", probe, _greedy(8), 0), *mates])
        assert tokens["probe"] == alone_tokens["probe"], arch
        _assert_same_logits(np.stack(logits["probe"]), expected)
        _logits_of(engine, [("probe", probe, _greedy(1), 0)], cache=True)
        cached_tokens, cached = _logits_of(engine, [("probe", probe, _greedy(8), 0)], cache=True)
        assert cached_tokens["probe"] == alone_tokens["probe"], arch
        _assert_same_logits(np.stack(cached["probe"]), expected)
        sent = alone_tokens["probe"][:3]
        resumed_tokens, resumed = _logits_of(engine, [("probe", probe + sent, _greedy(5), 3)])
        assert resumed_tokens["probe"] == alone_tokens["probe"][3:], arch
        _assert_same_logits(np.stack(resumed["probe"]), expected[3:])


def test_the_static_decode_step_gives_the_eager_logits(arch_path: Path):
    """What a GPU captures as graphs (runtime/decode_graphs.py), run here on the CPU: rows
    padded into buckets, past block boundaries and (olmo2, gemma2) their windows."""
    engine = Engine.load(
        str(arch_path),
        EngineConfig(backend="torch", device="cpu", torch_forward=True, max_sequences=8),
    )
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 250, n).tolist() for n in (40, 15, 16, 3, 9)]
    assert _side_by_side(engine, prompts, steps=4) == 4 * len(prompts)


def _have_converter() -> bool:
    return (
        importlib.util.find_spec("transformers") is not None
        and (hf_reference.LLAMA_CPP / "convert_hf_to_gguf.py").is_file()
    )


# llama.cpp's CPU GELU reads a float16 table (ggml's GGML_GELU_FP16): its gemma2 logits are
# 1.9e-3 from transformers' float32 ones, ours 5e-6
LLAMA_CPP_TOLERANCE = {"gemma2": 5e-3}


def _llama_cpp_logits(path: Path, tokens: np.ndarray) -> np.ndarray | None:
    """llama.cpp's own teacher-forced logits (float32 KV cache), where it is installed."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    import llama_cpp

    llm = llama_cpp.Llama(
        str(path), n_ctx=512, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0
    )
    try:
        llm.eval(tokens.tolist())
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


@pytest.mark.slow
@pytest.mark.skipif(not _have_converter(), reason="needs transformers and llama.cpp's source")
@pytest.mark.parametrize("name", sorted(hf_reference.CONFIGS))
def test_logits_equal_transformers_and_llama_cpp_on_its_conversion(name: str, tmp_path: Path):
    """The numpy host path (exact float32) on the f32 GGUF llama.cpp's converter wrote:
    transformers' float32 logits within 1e-4 (measured: up to 1e-5), and llama.cpp's own
    on that file within 1e-4 (measured: up to 8e-6; gemma2 see LLAMA_CPP_TOLERANCE), over
    a prompt and three decode steps."""
    hf_dir, gguf_path = hf_reference.build(name, tmp_path)
    tokens = np.random.default_rng(1).integers(0, hf_reference.VOCAB, 120)
    model = load_model(GGUFFile(gguf_path), get_backend("numpy"))
    got = _logits(model, tokens, [len(tokens) - 3, len(tokens) - 2, len(tokens) - 1])
    np.testing.assert_allclose(got, hf_reference.hf_logits(hf_dir, tokens), rtol=0, atol=1e-4)
    reference = _llama_cpp_logits(gguf_path, tokens)
    if reference is not None:
        atol = LLAMA_CPP_TOLERANCE.get(name, 1e-4)
        np.testing.assert_allclose(got, reference, rtol=0, atol=atol)
