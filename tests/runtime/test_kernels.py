"""The kernel layer: GGUF blocks into torch's layouts, the torch backend against the exact
numpy backend, and batched == one by one / cached == recomputed on the fast path."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from runtime.engine import Engine, EngineConfig
from runtime.gguf_file import GGUFFile
from runtime.kernels import TensorPart, get_backend
from runtime.kernels.gguf_blocks import GroupQuantized, read_four_bit
from runtime.kernels.torch_backend import MAX_INT8_ROW_ERROR, Int4Weight, int8_row_error
from runtime.models.base import BatchLayout, SequenceChunk
from runtime.sampling import SamplingParams
from tests.tiny_models import write_tiny_llama

Q = gguf.GGMLQuantizationType
ROWS, COLS = 48, 512  # two Q4_K / Q6_K super-blocks per row
# where each type keeps its float16 factors inside a block: (offset, count)
HALF_FIELDS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, 1), Q.Q4_0: (0, 1), Q.Q4_1: (0, 2)}


def random_blocks(qtype: Q, rows: int = ROWS, cols: int = COLS, seed: int = 0) -> np.ndarray:
    """Valid raw blocks of any type: random bytes with sane float16 factors, so the K-quants
    (which gguf can dequantize but not quantize) are covered too."""
    rng = np.random.default_rng(seed)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block_size, block_bytes), dtype=np.uint8)
    offset, count = HALF_FIELDS[qtype]
    halves = (rng.uniform(0.001, 0.01, (rows, cols // block_size, count))).astype(np.float16)
    raw[..., offset : offset + 2 * count] = halves.view(np.uint8)
    return raw.reshape(rows, -1)


def quantized(qtype: Q, seed: int = 0) -> np.ndarray:
    if qtype in HALF_FIELDS and qtype not in (Q.Q4_0, Q.Q4_1):
        return random_blocks(qtype, seed=seed)
    w = np.random.default_rng(seed).standard_normal((ROWS, COLS)).astype(np.float32) * 0.05
    return gguf.quants.quantize(w, qtype)


def write_types(path: Path, qtypes: list[Q]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for i, qtype in enumerate(qtypes):
        data = quantized(qtype, seed=i)
        if qtype == Q.F32:
            writer.add_tensor(f"w{i}", data)
        else:
            writer.add_tensor(f"w{i}", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_four_bit_blocks_read_as_exactly_what_gguf_dequantizes(qtype):
    raw = quantized(qtype)
    group = read_four_bit(raw, qtype, (ROWS, COLS))
    assert group.codes.max() <= 15
    np.testing.assert_array_equal(
        group.dequantize(), gguf.quants.dequantize(raw, qtype).reshape(ROWS, COLS)
    )


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K])
def test_int4_layout_holds_the_file_values_up_to_bf16_scales(qtype):
    """The int4 product equals bf16(x) @ W' where W' is the file's W with each group's
    scale and zero rounded to bf16: the one documented approximation of the layout."""
    group = read_four_bit(quantized(qtype), qtype, (ROWS, COLS))
    weight = Int4Weight(group, None)
    x = np.random.default_rng(1).standard_normal((5, COLS)).astype(np.float32)
    bf16 = lambda a: torch.from_numpy(np.ascontiguousarray(a)).bfloat16().double().numpy()  # noqa: E731
    zeros = bf16(group.mins + 8 * group.scales)
    codes = group.codes.reshape(ROWS, -1, 32).astype(np.float64) - 8
    w_layout = (codes * bf16(group.scales)[..., None] + zeros[..., None]).reshape(ROWS, COLS)
    expected = bf16(x) @ w_layout.T
    got = weight(x)
    # the kernel's own output is bf16: 2^-8 relative
    np.testing.assert_allclose(got, expected, rtol=2**-7, atol=2**-7 * np.abs(expected).max())
    exact = x.astype(np.float64) @ group.dequantize().T.astype(np.float64)
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()


def test_four_bit_row_operations_commute_with_dequantization():
    raw = quantized(Q.Q4_1)
    group = read_four_bit(raw, Q.Q4_1, (ROWS, COLS))
    order = np.random.default_rng(2).permutation(ROWS)
    dense = group.dequantize()
    np.testing.assert_allclose(group.take_rows(order).scaled(0.125).dequantize(), dense[order] / 8)
    both = GroupQuantized.concat([group, group.take_rows(order)])
    np.testing.assert_array_equal(both.dequantize(), np.concatenate([dense, dense[order]]))


ALL_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q5_0, Q.Q5_1, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_every_type_through_the_torch_backend_matches_the_numpy_backend(tmp_path, qtype):
    f = GGUFFile(write_types(tmp_path / "types.gguf", [qtype]))
    numpy_w = get_backend("numpy").linear(f, [TensorPart("w0")])
    torch_w = get_backend("torch").linear(f, [TensorPart("w0")])
    assert torch_w.kind == ("int4" if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else torch_w.kind)
    assert torch_w.nbytes < numpy_w.nbytes
    x = np.random.default_rng(3).standard_normal((3, COLS)).astype(np.float32)
    exact, fast = numpy_w(x), torch_w(x)
    rms = lambda a: float(np.sqrt(np.mean(a**2)))  # noqa: E731
    assert rms(fast - exact) < 0.02 * rms(exact)


def test_fused_parts_with_row_operations_match_the_numpy_backend(tmp_path):
    f = GGUFFile(write_types(tmp_path / "fused.gguf", [Q.Q4_1, Q.Q4_0]))
    order = np.random.default_rng(4).permutation(ROWS)
    parts = [TensorPart("w0", order, 0.5), TensorPart("w1")]
    scale = np.random.default_rng(5).uniform(0.5, 1.5, COLS).astype(np.float32)
    exact = get_backend("numpy").linear(f, parts, scale)
    fast = get_backend("torch").linear(f, parts, scale)
    assert fast.kind == "int4" and fast.shape == exact.shape == (2 * ROWS, COLS)
    x = np.random.default_rng(6).standard_normal((4, COLS)).astype(np.float32)
    assert np.abs(fast(x) - exact(x)).max() < 0.02 * np.abs(exact(x)).max()


def test_int8_is_taken_only_where_its_row_error_is_small():
    rng = np.random.default_rng(7)
    smooth = rng.standard_normal((64, 256)).astype(np.float32)
    assert int8_row_error(smooth) < MAX_INT8_ROW_ERROR
    spiky = smooth.copy()
    spiky[:, 0] = 200.0  # one outlier per row: the other values lose their precision
    assert int8_row_error(spiky) > MAX_INT8_ROW_ERROR


@pytest.fixture(scope="module")
def tiny_int4_engine(tmp_path_factory) -> Engine:
    path = write_tiny_llama(tmp_path_factory.mktemp("int4") / "q4.gguf", layer_type=Q.Q4_1)
    return Engine.load(str(path), EngineConfig(backend="torch"))


def _logits(engine: Engine, tokens: list[int]) -> np.ndarray:
    layout = BatchLayout([SequenceChunk(engine.model.new_cache(len(tokens)), 0, len(tokens))])
    return engine.model.logits(engine.model.forward(np.asarray(tokens), layout))


def test_tiny_int4_model_runs_on_int4_kernels(tiny_int4_engine):
    kinds = {layer.wqkv.kind for layer in tiny_int4_engine.model.layers}
    assert kinds == {"int4"}


def test_torch_batched_rows_equal_one_by_one(tiny_int4_engine):
    """Every product is row-independent, so a row's logits do not depend on its batch."""
    engine = tiny_int4_engine
    prompts = [[5, 9, 30, 41], [7, 8], [100, 3, 4, 5, 6, 7]]
    caches = [engine.model.new_cache(len(p)) for p in prompts]
    chunks = [SequenceChunk(c, 0, len(p)) for c, p in zip(caches, prompts, strict=True)]
    layout = BatchLayout(chunks)
    together = engine.model.logits(engine.model.forward(np.concatenate(prompts), layout))
    rows = np.cumsum([0] + [len(p) for p in prompts])
    for i, prompt in enumerate(prompts):
        np.testing.assert_array_equal(together[rows[i] : rows[i + 1]], _logits(engine, prompt))


def test_torch_cached_decode_equals_recompute(tiny_int4_engine):
    engine, tokens = tiny_int4_engine, [11, 12, 13, 14, 15, 16, 17]
    cache = engine.model.new_cache(len(tokens))
    model = engine.model
    model.forward(np.asarray(tokens[:-1]), BatchLayout([SequenceChunk(cache, 0, 6)]))
    hidden = model.forward(np.asarray(tokens[-1:]), BatchLayout([SequenceChunk(cache, 6, 1)]))
    stepped = engine.model.logits(hidden)[0]
    recomputed = _logits(engine, tokens)[-1]
    # prefill and decode attention sum in different orders before the bf16 products
    assert np.abs(stepped - recomputed).max() < 0.05 * np.abs(recomputed).max()


@pytest.mark.slow
def test_real_model_batched_and_prefix_cached_generation_equal_alone(smollm2_torch_engine):
    engine = smollm2_torch_engine
    system = [{"role": "system", "content": "You are a terse geography assistant."}]
    questions = ["What is the capital of France?", "Name a river in Egypt.", "Where is Peru?"]
    prompts = [engine.encode_chat(system + [{"role": "user", "content": q}]) for q in questions]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    alone = [[e.token_id for e in engine.generate(p, greedy)] for p in prompts]  # cache warms
    batch = engine.new_batch()
    for i, prompt in enumerate(prompts):
        batch.add(str(i), prompt, greedy)
    together: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while len(batch):
        for event in batch.step():
            together[event.request_id].append(event.token_id)
    assert [together[str(i)] for i in range(len(prompts))] == alone
    assert engine.prefix_cache.stats.hits > 0
