"""The tensor forward pass (what a GPU worker runs) against the host forward pass.

Every test runs on the CPU here, through exactly the code a CUDA device runs (weights,
KV pool, attention and sampling as torch tensors on one device), and again on CUDA where
there is a GPU (`gpu` marks). The host path with the exact numpy backend is the reference.
Golden agreement with llama.cpp for this path is in test_golden.py (`tensor-*` cases).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.devices import DeviceError, DeviceMemoryError
from runtime.engine import Engine, EngineConfig
from runtime.gguf_file import GGUFFile
from runtime.kernels.cpu import cpu_features, plan_for
from runtime.models.base import BatchLayout, SequenceChunk
from runtime.placement import Placement, load_placed, place
from runtime.sampling import Sampler, SamplingParams
from tests.runtime.generation_helpers import (
    GREEDY,
    random_tokens,
    run_all,
    same_kernels,
    tight_engine,
)
from tests.tiny_models import write_lora

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda:0", id="cuda", marks=pytest.mark.gpu),
]
# On the CPU the tensor path and the host torch path multiply with the same kernels (fp16,
# `same_kernels`), so the two differ only in the forward pass's code (attention, norms,
# rope, KV pool): float32 rounding. On a GPU, bf16 weights and fp16 keys/values against
# exact float32.
REFERENCE = {"cpu": "torch", "cuda:0": "numpy"}
LOGIT_TOLERANCE = {"cpu": 1e-4, "cuda:0": 0.25}


def tensor_config(device: str, **config) -> EngineConfig:
    return EngineConfig(backend="torch", device=device, torch_forward=True, **config)


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param


def _packed_logits(engine: Engine, prompts: list[list[int]], decode: int) -> list[np.ndarray]:
    """Each prompt prefilled in one packed forward pass, then `decode` steps that feed the
    prompts' own next tokens to all of them at once (prefill and decode rows mixed in the
    first step): logits of every row, host arrays."""
    model = engine.model
    caches = [model.new_cache(len(p) + decode, pool=engine.kv_pool) for p in prompts]
    chunks = [SequenceChunk(c, 0, len(p) - decode) for c, p in zip(caches, prompts, strict=True)]
    tokens = np.concatenate([p[: len(p) - decode] for p in prompts])
    out = [model.ops.to_host(model.logits(model.forward(tokens, BatchLayout(chunks))))]
    for step in range(decode):
        chunks = [
            SequenceChunk(c, len(p) - decode + step, 1)
            for c, p in zip(caches, prompts, strict=True)
        ]
        tokens = np.asarray([p[len(p) - decode + step] for p in prompts])
        out.append(model.ops.to_host(model.logits(model.forward(tokens, BatchLayout(chunks)))))
    for cache in caches:
        cache.release()
    return out


def test_tensor_logits_equal_the_host_path(tiny_model_path: Path, device: str):
    """Mixed prefill and decode rows of sequences of different lengths (the tiny gemma3's
    sliding window is 32, so the longest attend past it)."""
    kernels = same_kernels()
    exact = Engine.load(
        str(tiny_model_path), EngineConfig(backend=REFERENCE[device], kernels=kernels)
    )
    tensor = Engine.load(str(tiny_model_path), tensor_config(device, kernels=kernels))
    vocab = exact.model.vocab_size
    prompts = [random_tokens(n, seed=n, vocab=vocab) for n in (9, 40, 75)]
    expected = _packed_logits(exact, prompts, decode=4)
    got = _packed_logits(tensor, prompts, decode=4)
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(have, want, atol=LOGIT_TOLERANCE[device], rtol=0)


def test_batched_greedy_equals_one_by_one(tiny_model_path: Path, device: str):
    engine = Engine.load(str(tiny_model_path), tensor_config(device))
    vocab = engine.model.vocab_size
    requests = {
        f"r{i}": (random_tokens(5 + 11 * i, seed=i, vocab=vocab), SamplingParams(16, **GREEDY))
        for i in range(5)
    }
    together = run_all(engine.new_generator(), requests)
    for rid, request in requests.items():
        alone = run_all(engine.new_generator(), {rid: request})
        assert [e.token_id for e in together[rid]] == [e.token_id for e in alone[rid]]


@pytest.mark.slow
def test_real_model_batched_greedy_equals_one_by_one(smollm2_tensor_engine: Engine):
    engine = smollm2_tensor_engine
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a"]
    requests = {
        text: (engine.encode(text), SamplingParams(max_tokens=12, **GREEDY)) for text in prompts
    }
    together = run_all(engine.new_generator(), requests)
    for text, request in requests.items():
        alone = run_all(engine.new_generator(), {text: request})
        assert [e.token_id for e in together[text]] == [e.token_id for e in alone[text]]
    assert "Paris" in "".join(e.text for e in together[prompts[0]])


def test_cached_prefix_gives_exactly_the_cold_output(tiny_model_path: Path, device: str):
    engine = Engine.load(str(tiny_model_path), tensor_config(device))
    vocab = engine.model.vocab_size
    system = random_tokens(50, seed=2, vocab=vocab)
    first, second = system + random_tokens(5, 3, vocab), system + random_tokens(7, 4, vocab)
    params = SamplingParams(max_tokens=12, **GREEDY)
    cold = [e.token_id for e in engine.generate(second, params)]
    engine.prefix_cache.clear()
    list(engine.generate(first, params))
    events = list(engine.generate(second, params))
    assert events[0].cached_tokens == 48
    assert [e.token_id for e in events] == cold


def test_preemption_keeps_every_output_exact(tiny_model_path: Path, device: str):
    requests = {
        f"r{i}": (random_tokens(20 + 3 * i, seed=10 + i), SamplingParams(max_tokens=30, **GREEDY))
        for i in range(4)
    }
    roomy = Engine.load(str(tiny_model_path), tensor_config(device))
    expected = run_all(roomy.new_generator(), requests)
    tight = tight_engine(tiny_model_path, config=tensor_config(device))
    assert isinstance(tight.kv_pool.keys[0], torch.Tensor)  # the pool lives on the device
    generator = tight.new_generator()
    got = run_all(generator, requests)
    assert generator.preemptions > 0
    for rid in requests:
        assert [e.token_id for e in got[rid]] == [e.token_id for e in expected[rid]]


SAMPLING_CASES = [
    dict(temperature=0.8, seed=3),
    dict(temperature=1.0, top_p=0.9, seed=5),
    dict(temperature=0.7, top_k=5, seed=7),
    dict(temperature=1.3, min_p=0.05, seed=9),
    dict(temperature=0.9, top_k=50, top_p=0.8, min_p=0.02, seed=11),
    dict(temperature=0.8, presence_penalty=1.0, logit_bias={20: 3.0}, seed=2),  # host rows
    dict(temperature=0.0, logprobs=3),  # host rows
]


def test_device_sampling_draws_what_the_host_sampler_draws(device: str):
    """Random logits with a peaked head and a long tail; the device draws every row at
    once and copies back ids only, the host sampler works on the numpy copy."""
    from runtime.device_sampling import sample_device_rows, samples_on_device

    rng = np.random.default_rng(0)
    vocab, rows = 3000, len(SAMPLING_CASES) * 4
    logits = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    sampler = Sampler(vocab)
    params = [SamplingParams(**c) for c in SAMPLING_CASES for _ in range(4)]
    for p, i in zip(params, range(rows), strict=True):
        p.seed = None if p.seed is None else p.seed + i
    host_states = [sampler.new_state(p) for p in params]
    device_states = [sampler.new_state(p) for p in params]
    on_device = [i for i, s in enumerate(device_states) if samples_on_device(s)]
    assert len(on_device) == 20  # the last two cases need the host
    for _ in range(5):  # five steps: each row's generator advances once per draw
        expected = [r.token_id for r in sampler.sample(logits, host_states)]
        got = sample_device_rows(
            torch.from_numpy(logits).to(device), on_device, [device_states[i] for i in on_device]
        )
        assert got == [expected[i] for i in on_device]
        logits = np.roll(logits, 7, axis=1)


@pytest.mark.slow
def test_sampled_generation_on_the_tensor_path_equals_the_host_path(
    smollm2_fp16_engine: Engine, smollm2_fp16_tensor_engine: Engine
):
    """Seeded requests of every sampling kind, batched: the tensor path samples the same
    tokens as a CPU worker on the same kernels (the logits agree to ~1e-4)."""
    prompt = smollm2_fp16_tensor_engine.encode("Write a short poem about the sea.")
    requests = {
        str(i): (prompt, SamplingParams(max_tokens=16, ignore_eos=True, **case))
        for i, case in enumerate(SAMPLING_CASES)
    }
    host = run_all(smollm2_fp16_engine.new_generator(), requests)
    tensor = run_all(smollm2_fp16_tensor_engine.new_generator(), requests)
    for rid in requests:
        assert [e.token_id for e in tensor[rid]] == [e.token_id for e in host[rid]]
    assert tensor["6"][0].top_logprobs and tensor["6"][0].logprob is not None


@pytest.mark.slow
def test_prompt_logprobs_and_embeddings_come_back_as_host_arrays(
    smollm2_engine: Engine, smollm2_fp16_tensor_engine: Engine
):
    """Against exact float32; on fp16 kernels (with this CPU's bf16-activation kernels
    a logprob here was 0.09 off)."""
    tensor_engine = smollm2_fp16_tensor_engine
    ids = smollm2_engine.encode("The quick brown fox jumps")
    exact = smollm2_engine.prompt_logprobs(ids, top_n=2)
    tensor = tensor_engine.prompt_logprobs(ids, top_n=2)
    assert [t for _, t in tensor][1:] and len(tensor) == len(exact)
    for (want, _), (have, _) in zip(exact[1:], tensor[1:], strict=True):
        assert abs(have - want) < 0.05
    vectors = tensor_engine.embed([ids])
    assert isinstance(vectors, np.ndarray) and vectors.shape == (1, 576)
    assert float(vectors[0] @ smollm2_engine.embed([ids])[0]) > 0.999


def test_a_named_kernel_plan_reaches_both_paths(tiny_llama_path: Path):
    plan = same_kernels()
    host = Engine.load(str(tiny_llama_path), EngineConfig(backend="torch", kernels=plan))
    tensor = Engine.load(str(tiny_llama_path), tensor_config("cpu", kernels=plan))
    assert host.backend.plan == plan == tensor.backend.cpu.plan
    assert Engine.load(str(tiny_llama_path), EngineConfig(backend="torch")).backend.plan == (
        plan_for(cpu_features())
    )


def test_cuda_without_cuda_is_one_line_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(DeviceError) as error:
        place("cuda", None, None)
    assert "sees no CUDA device" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(DeviceError, match="cpu or cuda"):
        place("tpu", None, None)


def test_the_tensor_path_needs_the_torch_backend():
    with pytest.raises(DeviceError, match="needs the torch backend"):
        place("cpu", True, "numpy")
    assert place("cpu", None, "numpy").torch_forward is False  # the CPU's host path


def test_a_model_larger_than_the_gpu_is_refused_before_loading(monkeypatch, tiny_llama_path):
    """The weights' estimate against the device's free memory (here a fake GPU with 1 KiB
    free): a clear DeviceMemoryError naming both, nothing loaded."""
    from runtime import placement as placement_module
    from runtime.devices import DeviceMemory

    monkeypatch.setattr(placement_module, "device_memory", lambda d: DeviceMemory(1024, 2048))
    backend = place("cpu", True, None).backend
    with pytest.raises(DeviceMemoryError, match=r"tiny needs about .* MiB .* cuda:0 has 0 MiB"):
        load_placed(GGUFFile(tiny_llama_path), Placement("cuda:0", True, backend), "tiny")


def test_lora_on_the_tensor_path_equals_the_host_path(tiny_llama_path: Path, tmp_path: Path):
    adapter = write_lora(tmp_path / "a.gguf", tiny_llama_path, seed=0)
    engines = [
        Engine.load(str(tiny_llama_path), EngineConfig(backend="numpy")),
        Engine.load(str(tiny_llama_path), tensor_config("cpu")),
    ]
    prompt = random_tokens(12, seed=1)
    outputs = []
    for engine in engines:
        engine.load_adapter("a", adapter)
        params = SamplingParams(max_tokens=10, **GREEDY)
        plain = [e.token_id for e in engine.generate(prompt, params)]
        adapted = [e.token_id for e in engine.generate(prompt, params, lora=[("a", 4.0)])]
        outputs.append((plain, adapted))
    assert outputs[0] == outputs[1]
    assert outputs[0][0] != outputs[0][1]  # the adapter changes the output


def test_the_kv_pool_takes_its_share_of_free_gpu_memory(monkeypatch):
    """The default (half, capped at 16 GiB), an explicit share (uncapped), the environment's,
    and out-of-range shares refused with the setting's name."""
    from runtime import placement as placement_module
    from runtime.devices import DeviceMemory
    from runtime.placement import CUDA_KV_MAX_MB, GPU_SHARE_ENV, kv_budget_bytes

    gib = 2**30
    monkeypatch.setattr(
        placement_module, "device_memory", lambda d: DeviceMemory(80 * gib, 96 * gib)
    )
    monkeypatch.delenv(GPU_SHARE_ENV, raising=False)
    assert kv_budget_bytes(None, "cuda:0") == CUDA_KV_MAX_MB * 2**20
    assert kv_budget_bytes(None, "cuda:0", 0.9) == int(80 * gib * 0.9)
    assert kv_budget_bytes(64, "cuda:0", 0.9) == 64 * 2**20  # an explicit size wins
    monkeypatch.setenv(GPU_SHARE_ENV, "0.25")
    assert kv_budget_bytes(None, "cuda:0") == 20 * gib
    for bad in ("1.5", "none"):
        monkeypatch.setenv(GPU_SHARE_ENV, bad)
        with pytest.raises(DeviceError, match=GPU_SHARE_ENV if bad == "none" else r"0\.95"):
            kv_budget_bytes(None, "cuda:0")
    with pytest.raises(DeviceError, match="gpu_memory_utilization"):
        kv_budget_bytes(None, "cuda:0", 0.0)


def test_a_pool_too_small_for_one_sequence_is_refused_on_a_gpu():
    from runtime.placement import check_minimal_pool

    check_minimal_pool(10 * 2**20, 2**20, "cuda:0", "m")  # fits
    check_minimal_pool(1, 2**20, "cpu", "m")  # the CPU's pool is backed as used: no check
    with pytest.raises(DeviceMemoryError, match="gets 1 MiB on cuda:0.*needs 4 MiB.*--gpu-mem"):
        check_minimal_pool(2**20, 4 * 2**20, "cuda:0", "m")


@pytest.fixture(scope="module")
def gemma_types_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import write_tiny_gemma3_types

    return write_tiny_gemma3_types(tmp_path_factory.mktemp("gemma-types") / "gemma-types.gguf")


def test_gemma3s_weight_types_on_the_tensor_path_equal_the_host_path(gemma_types_path, device):
    """Q4_K, Q5_0, Q6_K and Q8_0 weights, a 20,000-row tied head and a sliding window of 24,
    prefilled and decoded past the window, against the exact host path."""
    from tests.tiny_models import GEMMA_TYPES

    exact = Engine.load(str(gemma_types_path), EngineConfig(backend="numpy"))
    tensor = Engine.load(str(gemma_types_path), tensor_config(device))
    qtypes = {GGUFFile(gemma_types_path).blocks(f"blk.0.{r}.weight")[1] for r in GEMMA_TYPES}
    assert {t.name for t in qtypes} == {"Q4_K", "Q5_0", "Q6_K"}
    assert exact.model.vocab_size == tensor.model.vocab_size == 20000
    prompts = [random_tokens(n, seed=n, vocab=260) for n in (9, 30, 47)]
    expected = _packed_logits(exact, prompts, decode=6)
    got = _packed_logits(tensor, prompts, decode=6)
    scale = max(float(np.abs(e).max()) for e in expected)
    clear = 0
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(have, want, atol=0.05 * scale, rtol=0)
        top2 = np.sort(want, axis=1)[:, -2:]
        margin = top2[:, 1] - top2[:, 0] > 0.1 * scale  # rows whose choice is clear
        np.testing.assert_array_equal(have.argmax(axis=1)[margin], want.argmax(axis=1)[margin])
        clear += int(margin.sum())
    assert clear > 0


def test_the_cuda_int4_packing_tiles_every_built_in_models_k():
    """torch's CUDA int4 packing needs K divisible by its inner tiles x 16: SmolLM2's
    hidden size 576 takes 4 tiles, its FFN 1536 and Gemma 3's 640 / 2048 take 8."""
    from runtime.kernels.device_backend import inner_k_tiles

    shapes = {576: 4, 1536: 8, 640: 8, 2048: 8, 1024: 8, 96: 2, 32: 2, 160: 2, 192: 4}
    assert {k: inner_k_tiles(k) for k in shapes} == shapes
    for k, tiles in shapes.items():
        assert k % (tiles * 16) == 0
    with pytest.raises(ValueError, match="divisible by 32, got 48"):
        inner_k_tiles(48)
