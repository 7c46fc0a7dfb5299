"""A request's logits are bitwise the same alone and in any batch (CONTRACT "Same request,
same answer"), on this CPU's default plan and on the AVX2 plan forced here
(`LLMQ_CPU_LEVEL=avx2`: the plan and every native kernel built as an AVX2-only CPU gets
them), with LoRA stacks, other adapters, scale 0.0 and grammar rows beside it, and with
its prompt computed in two passes (as after a prefix-cache hit or a resume).

Some sequences (every adapter mix, and rows far into the batch) are first run alone: the
prompt in one pass, then one decode step. Then the first 2, 9, 32 and 64 run together:
every prompt in two passes (a part of each, then the rest, mixed with other sequences),
then one decode step for all. Each of those rows' logits must equal its alone run's bit
for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from runtime.constraints import Constraint
from runtime.engine import Engine, EngineConfig
from runtime.gguf_file import GGUFFile
from runtime.kernels import get_backend
from runtime.kernels.cpu_features import LEVEL_ENV, cpu_features, forced_level
from runtime.kernels.native import paged_attention
from runtime.lora import load_adapter
from runtime.models import load_model
from runtime.models.base import BatchLayout, SequenceChunk
from runtime.registry import ModelSpec
from runtime.sampling import SamplingParams
from tests.tiny_models import write_lora, write_tiny_gemma3_types, write_tiny_llama

pytestmark = pytest.mark.skipif(paged_attention() is None, reason="no C compiler")
BATCHES = (2, 9, 32, 64)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_types_path(tmp_path_factory) -> Path:
    """A tiny gemma3 with Gemma 3's weight types (Q4_K, Q5_0, Q6_K, a Q8_0 head)."""
    return write_tiny_gemma3_types(tmp_path_factory.mktemp("types") / "g.gguf", vocab_rows=600)


def _stacks(a, b) -> list[tuple]:
    """The mix a batch's rows take, in turn: none, one adapter, scale 0.0, two adapters."""
    return [(), ((a, 1.0),), ((a, 0.0),), ((b, -0.5),), ((a, 0.5), (b, 2.0)), ((b, 1.0),)]


def _sequences(count: int, vocab: int, stacks: list[tuple]) -> list[tuple[np.ndarray, tuple]]:
    rng = np.random.default_rng(count)
    lengths = rng.integers(2, 12, count)
    return [(rng.integers(0, vocab, n), stacks[i % len(stacks)]) for i, n in enumerate(lengths)]


def _pass(model, chunks: list[tuple]) -> list[np.ndarray]:
    """One forward pass of (cache, start, tokens, stack) chunks: each chunk's logits."""
    layout = BatchLayout([SequenceChunk(c, s, len(t), st) for c, s, t, st in chunks])
    hidden = model.forward(np.concatenate([t for _, _, t, _ in chunks]), layout)
    logits = model.logits(hidden)
    ends = np.cumsum([len(t) for _, _, t, _ in chunks])
    return [logits[end - len(t) : end] for end, (_, _, t, _) in zip(ends, chunks, strict=True)]


def _alone(model, tokens: np.ndarray, stack: tuple, next_token: int) -> np.ndarray:
    cache = model.new_cache(len(tokens) + 1)
    prompt = _pass(model, [(cache, 0, tokens, stack)])[0]
    step = _pass(model, [(cache, len(tokens), np.array([next_token]), stack)])[0]
    return np.concatenate([prompt, step])


def _batched(model, sequences: list[tuple], next_tokens: list[int]) -> list[np.ndarray]:
    """The prompts in two passes (their first parts, then the rest), then one decode step."""
    pool = model.new_kv_pool(sum(len(t) + 1 for t, _ in sequences) + 64 * len(sequences))
    caches = [model.new_cache(len(t) + 1, pool) for t, _ in sequences]
    cuts = [len(t) // 2 for t, _ in sequences]
    first = [(c, 0, t[:h], s) for c, h, (t, s) in zip(caches, cuts, sequences, strict=True) if h]
    firsts = iter(_pass(model, first))
    rest = _pass(
        model, [(c, h, t[h:], s) for c, h, (t, s) in zip(caches, cuts, sequences, strict=True)]
    )
    head = [next(firsts) if h else np.empty((0, model.vocab_size), np.float32) for h in cuts]
    steps = [
        (c, len(t), np.array([n]), s)
        for c, (t, s), n in zip(caches, sequences, next_tokens, strict=True)
    ]
    decoded = _pass(model, steps)
    return [np.concatenate(parts) for parts in zip(head, rest, decoded, strict=True)]


PROBES = (*range(9), 13, 20, 31, 47, 63)  # the rows run alone: every mix, in every batch


def _check(model, sequences: list[tuple], batches: tuple[int, ...]) -> None:
    next_tokens = [int(t[-1]) for t, _ in sequences]
    probes = [i for i in PROBES if i < len(sequences)]
    alone = {i: _alone(model, *sequences[i], next_tokens[i]) for i in probes}
    for size in batches:
        batched = _batched(model, sequences[:size], next_tokens[:size])
        for i in (i for i in probes if i < size):
            got, want = batched[i], alone[i]
            assert got.shape == want.shape
            assert np.array_equal(got, want), (
                f"row {i} (adapters {[(a.name, s) for a, s in sequences[i][1]]}) in a batch of "
                f"{size}: logits differ by up to {np.abs(got - want).max():.3g} from alone"
            )


def _lora_file(path: Path, model, seed: int, rank: int) -> Path:
    """An adapter on every layer's q, v and up weights, as tests/tiny_models.py `write_lora`
    writes one, with the shapes from the loaded model (gguf's reader takes seconds to
    parse SmolLM2's vocabulary)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), model.architecture)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 2.0 * rank)
    for name, source in model.linear_sources.items():
        if name.split(".")[2] in ("attn_q", "attn_v", "ffn_up"):
            out, inp = source.shape
            writer.add_tensor(
                name + ".lora_a", (rng.standard_normal((rank, inp)) / inp**0.5).astype(np.float32)
            )
            writer.add_tensor(
                name + ".lora_b",
                (0.5 * rng.standard_normal((out, rank)) / rank**0.5).astype(np.float32),
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _with_adapters(path: Path, tmp_path: Path):
    model = load_model(GGUFFile(path), get_backend("torch"))
    adapters = [
        load_adapter(
            name,
            _lora_file(tmp_path / f"{name}.gguf", model, seed, rank),
            model.linear_sources,
            model.architecture,
        )
        for name, seed, rank in (("A", 1, 8), ("B", 2, 4))
    ]
    return model, _stacks(*adapters)


@pytest.mark.parametrize("which", ["llama", "gemma3-types"])
def test_a_rows_logits_are_the_same_alone_and_in_batches_of_2_9_32_64(
    which, tmp_path, tiny_llama_path, tiny_types_path
):
    path = tiny_llama_path if which == "llama" else tiny_types_path
    model, stacks = _with_adapters(path, tmp_path)
    _check(model, _sequences(max(BATCHES), model.vocab_size, stacks), BATCHES)


def test_the_tiny_llama_with_every_layer_q8_0_or_f16_is_row_invariant(tmp_path):
    """The types the mixed models above do not cover in every role."""
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16):
        path = write_tiny_llama(tmp_path / f"{qtype.name}.gguf", layer_type=qtype)
        model, stacks = _with_adapters(path, tmp_path)
        _check(model, _sequences(12, model.vocab_size, stacks), (9,))


def test_smollm2_rows_are_the_same_alone_and_in_a_mixed_batch(tmp_path, smollm2_gguf_path):
    """The real file (Q4_1 layers, a tied Q8_0 head): a few rows alone against a batch of
    32 with two adapters at several scales, kept to a few seconds."""
    model, stacks = _with_adapters(smollm2_gguf_path, tmp_path)
    sequences = _sequences(32, model.vocab_size, stacks)
    next_tokens = [int(t[-1]) for t, _ in sequences]
    batched = _batched(model, sequences, next_tokens)
    for i in (0, 1, 2, 4, 31):
        tokens, stack = sequences[i]
        assert np.array_equal(batched[i], _alone(model, tokens, stack, next_tokens[i])), f"row {i}"


def _probe_logits(engine: Engine, others: list[tuple[list[int], SamplingParams, tuple]]):
    """A greedy request's logits at each sampled step, run beside `others` in one generator."""
    generator = engine.new_generator()
    recorded: list[np.ndarray] = []
    sample = generator.runner.host_rows.sample

    def recording(host_logits, rows):
        for values, row in zip(host_logits, rows, strict=True):
            if row.request_id == "probe":
                recorded.append(np.array(values))
        return sample(host_logits, rows)

    generator.runner.host_rows.sample = recording
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    probe = engine.adapter_stack([("A", 1.0)])
    generator.add("probe", [5, 17, 42, 99, 3, 250, 61], greedy, adapters=probe)
    for i, (prompt, params, stack) in enumerate(others):
        generator.add(f"other{i}", prompt, params, adapters=stack)
    while len(generator):
        generator.step()
    return recorded


def test_a_lora_request_beside_grammar_rows_and_other_scales_gets_its_logits(
    tmp_path, tiny_llama_path
):
    """The generator: a request with an adapter at 1.0, alone and beside eight others (the
    base model, the same adapter at 1.0 and 0.0, another adapter, two grammar rows)."""
    spec = ModelSpec("tiny", str(tiny_llama_path), lambda: tiny_llama_path)
    engine = Engine(spec, GGUFFile(tiny_llama_path), EngineConfig(backend="torch"))
    for name, seed in (("A", 1), ("B", 2)):
        engine.load_adapter(name, write_lora(tmp_path / f"{name}.gguf", tiny_llama_path, seed=seed))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    grammar = SamplingParams(max_tokens=8, constraint=Constraint("regex", "[a-z ]{1,20}"))
    others = [
        ([9, 8, 7], greedy, ()),
        ([40, 41, 42, 43, 44], greedy, engine.adapter_stack([("A", 1.0)])),
        ([12], greedy, engine.adapter_stack([("A", 0.0)])),
        ([60, 61], greedy, engine.adapter_stack([("B", 1.0)])),
        ([70, 71, 72], grammar, ()),
        ([80, 81], grammar, engine.adapter_stack([("A", 0.5), ("B", 1.0)])),
        ([90, 91, 92, 93], greedy, engine.adapter_stack([("A", 2.0)])),
        ([100], greedy, ()),
    ]
    alone = _probe_logits(engine, [])
    beside = _probe_logits(engine, others)
    assert len(alone) == len(beside) == 6
    for step, (a, b) in enumerate(zip(alone, beside, strict=True)):
        assert np.array_equal(a, b), f"step {step} differs by {np.abs(a - b).max():.3g}"


@pytest.mark.skipif(
    forced_level() == "avx2" or "avx512f" not in cpu_features().flags,
    reason="forced already, or this CPU's own plan is the AVX2 one",
)
def test_the_same_with_the_avx2_plan_and_builds_forced():
    """This module again in a process that sees an AVX2-only CPU: the AVX2 plan (the 4- and
    5-bit weights in lowbit_rows.c, Q8_0 / Q6_K codes in int8_rows.c, F16 in dense_rows.c)
    and every native kernel compiled without AVX-512 or VNNI."""
    env = os.environ | {LEVEL_ENV: "avx2"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            __file__,
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-k",
            "not forced",
            "-W",
            "error",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout


def test_the_forced_avx2_plan_is_the_avx2_one():
    """Where the level is forced (the run above), the plan is the AVX2 plan's."""
    from runtime.kernels.cpu import default_plan

    if forced_level() != "avx2":
        pytest.skip("runs inside the forced AVX2 process")
    assert cpu_features().level == "avx2"
    plan = default_plan()
    assert (plan.eight_bit, plan.other, plan.head) == ("int8-block-groups", "fp16-rows", "file")
