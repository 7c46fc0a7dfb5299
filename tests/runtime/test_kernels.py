"""The kernel layer: GGUF blocks into torch's layouts, the torch backend against the exact
numpy backend, and batched == one by one / cached == recomputed on the fast path."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from runtime.gguf_file import GGUFFile
from runtime.kernels import TensorPart, get_backend
from runtime.kernels.cpu import KernelPlan
from runtime.kernels.gguf_blocks import GroupQuantized, read_five_bit, read_four_bit
from runtime.kernels.native import lowbit_rows
from runtime.kernels.torch_backend import (
    MAX_INT8_ROW_ERROR,
    Int4Weight,
    TorchBackend,
    int8_row_error,
)
from runtime.models import load_model
from runtime.models.base import BatchLayout, SequenceChunk
from runtime.sampling import SamplingParams
from tests.runtime.quant_blocks import random_blocks
from tests.tiny_models import write_tiny_llama

Q = gguf.GGMLQuantizationType
ROWS, COLS = 48, 512  # two Q4_K / Q6_K super-blocks per row


def quantized(qtype: Q, seed: int = 0) -> np.ndarray:
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):  # gguf dequantizes the K-quants, quantizes none
        return random_blocks(qtype, ROWS, COLS, seed)
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


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1])
def test_five_bit_blocks_read_as_exactly_what_gguf_dequantizes(qtype):
    raw = quantized(qtype)
    group = read_five_bit(raw, qtype, (ROWS, COLS))
    assert group.codes.max() <= 31 and group.codes.max() > 15
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
FOUR_BIT = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
FIVE_BIT = (Q.Q5_0, Q.Q5_1)
# every kernel, whatever this CPU's own plan is: AVX-512's and AVX2's
PLANS = {
    "int4-bf16": KernelPlan("int4", "bf16", "int8", 2, head_fallback="bf16"),
    "torch-int4-bf16": KernelPlan("int4", "bf16", "int8", 2, head_fallback="bf16"),
    "fp16": KernelPlan("fp16", "fp16", "int8", 2, head_fallback="fp16"),
}
# int4_rows.c where it builds (every machine with a C compiler), and torch's int4 kernel
NATIVE = lowbit_rows(4) is not None and lowbit_rows(5) is not None
KIND_OF_FOUR_BIT = {
    "int4-bf16": "int4-blocks" if NATIVE else "int4",
    "torch-int4-bf16": "int4",
    "fp16": "fp16",
}


def backend_for(plan: str) -> TorchBackend:
    return TorchBackend(plan=PLANS[plan], native_lowbit=not plan.startswith("torch-"))


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_every_type_on_every_plan_matches_the_numpy_backend(tmp_path, qtype, plan):
    f = GGUFFile(write_types(tmp_path / "types.gguf", [qtype]))
    numpy_w = get_backend("numpy").linear(f, [TensorPart("w0")])
    torch_w = backend_for(plan).linear(f, [TensorPart("w0")])
    if qtype in FOUR_BIT:
        assert torch_w.kind == KIND_OF_FOUR_BIT[plan]
    if qtype in FIVE_BIT:
        native = plan == "int4-bf16" and NATIVE
        assert torch_w.kind == ("int5-blocks" if native else PLANS[plan].other)
    assert torch_w.nbytes < numpy_w.nbytes
    rms = lambda a: float(np.sqrt(np.mean(a**2)))  # noqa: E731
    for rows in (1, 3):
        x = np.random.default_rng(rows).standard_normal((rows, COLS)).astype(np.float32)
        exact, fast = numpy_w(x), torch_w(x)
        assert rms(fast - exact) < 0.02 * rms(exact)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_fused_parts_with_row_operations_match_the_numpy_backend(tmp_path, plan):
    f = GGUFFile(write_types(tmp_path / "fused.gguf", [Q.Q4_1, Q.Q4_0]))
    order = np.random.default_rng(4).permutation(ROWS)
    parts = [TensorPart("w0", order, 0.5), TensorPart("w1")]
    scale = np.random.default_rng(5).uniform(0.5, 1.5, COLS).astype(np.float32)
    exact = get_backend("numpy").linear(f, parts, scale)
    fast = backend_for(plan).linear(f, parts, scale)
    assert fast.kind == KIND_OF_FOUR_BIT[plan] and fast.shape == exact.shape == (2 * ROWS, COLS)
    for rows in (1, 4):
        x = np.random.default_rng(6).standard_normal((rows, COLS)).astype(np.float32)
        assert np.abs(fast(x) - exact(x)).max() < 0.02 * np.abs(exact(x)).max()


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_head_is_int8_only_where_accurate_enough(tmp_path, plan):
    smooth = np.random.default_rng(8).standard_normal((ROWS, COLS)).astype(np.float32)
    spiky = smooth.copy()
    spiky[:, 0] = 200.0
    path = tmp_path / "heads.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("smooth", smooth)
    writer.add_tensor("spiky", spiky)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f, backend = GGUFFile(path), backend_for(plan)
    int8 = "int8-groups" if backend.grouped_int8 else "int8"  # lowbit_rows.c's, with VNNI
    assert backend.head(f, "smooth").kind == int8
    fallback = backend.head(f, "spiky")
    assert fallback.kind == PLANS[plan].head_fallback
    for name, head in (("smooth", backend.head(f, "smooth")), ("spiky", fallback)):
        assert backend.stored_bytes(f, name, "head") == head.nbytes
        x = np.random.default_rng(9).standard_normal((2, COLS)).astype(np.float32)
        exact = x @ f.tensor(name).T
        assert np.abs(head(x) - exact).max() < 0.02 * np.abs(exact).max()


def test_int8_is_taken_only_where_its_row_error_is_small():
    rng = np.random.default_rng(7)
    smooth = rng.standard_normal((64, 256)).astype(np.float32)
    assert int8_row_error(smooth) < MAX_INT8_ROW_ERROR
    spiky = smooth.copy()
    spiky[:, 0] = 200.0  # one outlier per row: the other values lose their precision
    assert int8_row_error(spiky) > MAX_INT8_ROW_ERROR


@pytest.fixture(scope="module", params=sorted(PLANS))
def tiny_q4_model(request, tmp_path_factory):
    """A tiny llama whose layers are all Q4_1, on each plan's kernels."""
    path = write_tiny_llama(tmp_path_factory.mktemp("int4") / "q4.gguf", layer_type=Q.Q4_1)
    model = load_model(GGUFFile(path), backend_for(request.param))
    return request.param, model


def _logits(model, tokens: list[int]) -> np.ndarray:
    layout = BatchLayout([SequenceChunk(model.new_cache(len(tokens)), 0, len(tokens))])
    return model.logits(model.forward(np.asarray(tokens), layout))


def test_tiny_q4_model_runs_on_the_plans_kernels(tiny_q4_model):
    plan, model = tiny_q4_model
    assert {layer.wqkv.kind for layer in model.layers} == {KIND_OF_FOUR_BIT[plan]}


def test_torch_batched_rows_equal_one_by_one(tiny_q4_model):
    """A row's logits do not depend on the other rows of its batch: exactly for int4, to
    float32 rounding for fp16 (fbgemm blocks rows)."""
    plan, model = tiny_q4_model
    prompts = [[5, 9, 30, 41], [7, 8, 9], [100, 3, 4, 5, 6, 7]]
    pool = model.new_kv_pool(3 * 16)  # one forward pass attends over one pool
    caches = [model.new_cache(len(p), pool) for p in prompts]
    chunks = [SequenceChunk(c, 0, len(p)) for c, p in zip(caches, prompts, strict=True)]
    together = model.logits(model.forward(np.concatenate(prompts), BatchLayout(chunks)))
    rows = np.cumsum([0] + [len(p) for p in prompts])
    for i, prompt in enumerate(prompts):
        alone = _logits(model, prompt)
        if plan == "int4-bf16":
            np.testing.assert_array_equal(together[rows[i] : rows[i + 1]], alone)
        else:
            np.testing.assert_allclose(together[rows[i] : rows[i + 1]], alone, atol=1e-4)


def test_torch_cached_decode_equals_recompute(tiny_q4_model):
    _, model = tiny_q4_model
    tokens = [11, 12, 13, 14, 15, 16, 17]
    cache = model.new_cache(len(tokens))
    model.forward(np.asarray(tokens[:-1]), BatchLayout([SequenceChunk(cache, 0, 6)]))
    hidden = model.forward(np.asarray(tokens[-1:]), BatchLayout([SequenceChunk(cache, 6, 1)]))
    stepped = model.logits(hidden)[0]
    recomputed = _logits(model, tokens)[-1]
    # prefill and decode attention sum in different orders before the products round
    assert np.abs(stepped - recomputed).max() < 0.05 * np.abs(recomputed).max()


@pytest.mark.slow
def test_real_model_batched_and_prefix_cached_generation_equal_alone(smollm2_torch_engine):
    engine = smollm2_torch_engine
    system = [{"role": "system", "content": "You are a terse geography assistant."}]
    questions = ["What is the capital of France?", "Name a river in Egypt.", "Where is Peru?"]
    prompts = [engine.encode_chat(system + [{"role": "user", "content": q}]) for q in questions]
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    alone = [[e.token_id for e in engine.generate(p, greedy)] for p in prompts]  # cache warms
    generator = engine.new_generator()
    for i, prompt in enumerate(prompts):
        generator.add(str(i), prompt, greedy)
    together: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while len(generator):
        for event in generator.step():
            together[event.request_id].append(event.token_id)
    assert [together[str(i)] for i in range(len(prompts))] == alone
    assert engine.prefix_cache.stats.hits > 0


def test_kv_cache_type_comes_from_the_environment(monkeypatch, tiny_llama_path):
    """`LLMQ_KV_CACHE=float16` gives the host path a half pool; a typo is a clear error."""
    from runtime.engine import Engine
    from runtime.kernels.cpu import default_plan

    assert default_plan().kv == "float32"
    monkeypatch.setenv("LLMQ_KV_CACHE", "float16")
    engine = Engine.load(str(tiny_llama_path))
    assert engine.kv_pool.keys[0].dtype == np.float16
    assert engine.backend.describe()["kv cache"] == "float16"
    monkeypatch.setenv("LLMQ_KV_CACHE", "f16")
    with pytest.raises(ValueError, match="LLMQ_KV_CACHE must be one of float32, float16"):
        default_plan()


@pytest.mark.slow
@pytest.mark.parametrize("native", [True, False], ids=["lowbit_rows", "torch-int4"])
def test_rescored_head_gives_the_files_logits_for_its_best_rows(gemma3_gguf_path, native):
    """Gemma 3's Q8_0 head, ranked by its int4 copy: the best rows' logits are the file's
    values times the query (float64 reference), the argmax is the exact one, and a row's
    logits are bitwise the same alone and among others."""
    from runtime.kernels.torch_backend import RESCORED_ROWS, RescoredHead, TorchBackend

    f = GGUFFile(gemma3_gguf_path)
    plan = KernelPlan("int4", "fp16", "int8", 2, head_fallback="int4+rescore")
    head = TorchBackend(plan, native_lowbit=native).head(f, "token_embd.weight")
    assert isinstance(head, RescoredHead)
    assert head.ranking.kind == ("int4-blocks+rescore" if native and NATIVE else "int4+rescore")
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((12, head.shape[1])).astype(np.float32))
    got = head.product(x)
    exact = x.double() @ torch.from_numpy(f.tensor("token_embd.weight")).double().T
    assert torch.equal(got.argmax(1), exact.argmax(1))
    best = torch.topk(exact, 8, dim=1).indices  # well inside the rescored rows
    assert RESCORED_ROWS >= 8
    np.testing.assert_allclose(got.gather(1, best), exact.gather(1, best).float(), rtol=1e-6)
    alone = torch.cat([head.product(x[i : i + 1]) for i in range(len(x))])
    assert torch.equal(alone, got)


def test_an_avx2_cpu_gets_integer_dots_for_every_quantized_weight_where_they_build():
    """AVX2 without AVX-512: GGUF's 4- and 5-bit weights go to lowbit_rows.c's AVX2 build
    (the same numbers as the AVX-512 build, tests/runtime/test_lowbit_rows.py), Q8_0 and
    Q6_K as their codes to int8_rows.c, the head as its type says, F16 to dense_rows.c;
    without a compiler, torch's row-invariant kernels."""
    from runtime.kernels.cpu import CpuFeatures, plan_for

    plan = plan_for(CpuFeatures(frozenset({"avx2", "fma", "f16c"}), 2))
    assert plan.four_bit == "int4"
    if NATIVE:
        assert (plan.eight_bit, plan.other, plan.head) == ("int8-block-groups", "fp16-rows", "file")
        assert plan.large_head == "int4+rescore"
    else:
        assert (plan.eight_bit, plan.other, plan.head) == ("", "bf16", "int8")


def test_a_head_over_the_large_head_rows_takes_the_plans_large_head_kind(tmp_path, monkeypatch):
    """The AVX2 plan's `large_head`: a head of more than LARGE_HEAD_ROWS rows (Gemma 3's
    262k) ranks by int4 and rescores its best rows, a smaller one (SmolLM2's 49k) stays
    fp16; the limit is lowered here so that tiny heads stand for both."""
    from runtime.kernels import torch_backend
    from runtime.kernels.torch_backend import RescoredHead, TorchBackend

    rng = np.random.default_rng(12)
    path = tmp_path / "heads.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("small", rng.standard_normal((96, COLS)).astype(np.float32))
    writer.add_tensor("large", rng.standard_normal((160, COLS)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setattr(torch_backend, "LARGE_HEAD_ROWS", 128)
    plan = KernelPlan("int4", "fp16", "fp16", 2, head_fallback="fp16", large_head="int4+rescore")
    f, backend = GGUFFile(path), TorchBackend(plan)
    assert backend.head(f, "small").kind == "fp16"
    large = backend.head(f, "large")
    assert isinstance(large, RescoredHead)
    assert backend.stored_bytes(f, "large", "head") == large.nbytes
    x = rng.standard_normal((3, COLS)).astype(np.float32)
    exact = x.astype(np.float64) @ f.tensor("large").astype(np.float64).T
    assert np.array_equal(large(x).argmax(1), exact.argmax(1))
    assert "over 100,000 rows int4+rescore" in plan.describe()["lm head"]
