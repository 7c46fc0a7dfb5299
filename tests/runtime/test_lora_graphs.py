"""LoRA rows in the static decode step (runtime/lora_slots.py, runtime/decode_graphs.py).

A step with LoRA rows runs in a LoRA bucket: the adapters sit in the engine's slots and a
per-row coefficient table says which slots each row uses at what scale. The cases here hold
that step to the eager step's logits bit for bit (in several batch buckets with padding
rows, rows without adapters, with one, with two at different scales, and scale 0.0), a
request's answer to its answer alone in batches of 2, 9 and 32, the answer through slot
reuse and through the eager fallback when the slots cannot hold a step, and each delta to
the float32 reference. The `gpu` cases run the captured graphs on CUDA.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.engine import Engine, EngineConfig
from runtime.lora import RowAdapters, normalize_stack
from runtime.lora_slots import LoraSlots, gemm_delta, rows_delta
from runtime.models.base import BatchLayout, SequenceChunk
from runtime.sampling import SamplingParams
from tests.runtime.test_decode_graphs import DEVICES, _assert_same_logits
from tests.tiny_models import TinyShape, write_lora, write_tiny_gemma3, write_tiny_llama

# two table widths (256 and 512 positions); gemma3's window of 40 positions
SHAPES = {
    "llama": TinyShape(context_length=512),
    "gemma3": TinyShape(n_layers=6, head_dim=32, context_length=512, sliding_window=40),
}
EVERY_WEIGHT = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """Per architecture the model and its adapters: `a` (q, v, up at rank 8), `b` (every
    weight at rank 4), and `c0`..`c4` for slot reuse."""
    d = tmp_path_factory.mktemp("lora-graphs")
    out = {}
    for arch, write in (("llama", write_tiny_llama), ("gemma3", write_tiny_gemma3)):
        model = write(d / f"{arch}.gguf", SHAPES[arch])
        files = {"model": model}
        files["a"] = write_lora(d / f"{arch}-a.gguf", model, seed=1)
        files["b"] = write_lora(d / f"{arch}-b.gguf", model, EVERY_WEIGHT, rank=4, seed=2)
        for i in range(5):
            files[f"c{i}"] = write_lora(d / f"{arch}-c{i}.gguf", model, seed=10 + i)
        out[arch] = files
    return out


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    if request.param.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    return request.param


def _engine(files: dict[str, Path], device: str, adapters=("a", "b"), **config) -> Engine:
    engine = Engine.load(
        str(files["model"]),
        EngineConfig(backend="torch", device=device, torch_forward=True, **config),
    )
    for name in adapters:
        engine.load_adapter(name, files[name])
    return engine


def _stacks(engine: Engine) -> list[tuple]:
    """The mix a batch's rows take, in turn: none, one adapter, scale 0.0, two adapters at
    different scales, the other adapter alone."""
    a, b = engine.adapters["a"], engine.adapters["b"]
    mix = [(), ((a, 1.0),), ((a, 0.0),), ((b, -0.5),), ((a, 0.5), (b, 2.0)), ((b, 1.0),)]
    return [normalize_stack(stack) for stack in mix]


def _host(logits: torch.Tensor) -> np.ndarray:
    return logits.float().cpu().numpy()


def _assert_same_answer(got: list, want: list, device: str) -> None:
    """The same tokens; the same logprobs bit for bit where the base products are (CUDA,
    AVX-512: `_assert_same_logits`), else to 1e-5."""
    assert [t for t, *_ in got] == [t for t, *_ in want]
    logprobs = [np.array([[lp] for _, lp, _ in answer]) for answer in (got, want)]
    _assert_same_logits(*logprobs, device)
    if np.array_equal(*logprobs):
        assert got == want  # the alternatives too


def _prefilled(engine: Engine, prompts: list[list[int]], stacks: list[tuple]) -> list:
    """One cache per prompt in the engine's pool, each prefilled alone with its stack."""
    model, caches = engine.model, []
    for prompt, stack in zip(prompts, stacks, strict=True):
        cache = model.new_cache(len(prompt) + 8, pool=engine.kv_pool)
        chunk = SequenceChunk(cache, 0, len(prompt), stack)
        model.forward(np.asarray(prompt), BatchLayout([chunk]))
        caches.append(cache)
    return caches


def _side_by_side(engine: Engine, prompts: list[list[int]], stacks: list[tuple], steps: int):
    """Decode `steps` tokens of every prompt through the eager and the static step; assert
    equal logits each step, and that the static step ran in a LoRA bucket."""
    model, graphs = engine.model, engine.decode_graphs
    eager, static = _prefilled(engine, prompts, stacks), _prefilled(engine, prompts, stacks)
    tokens = [p[-1] for p in prompts]
    passes = max(len(s) for s in stacks)
    for _ in range(steps):
        rows_e = [SequenceChunk(c, c.length, 1, s) for c, s in zip(eager, stacks, strict=True)]
        rows_s = [SequenceChunk(c, c.length, 1, s) for c, s in zip(static, stacks, strict=True)]
        for cache in eager + static:
            cache.reserve(cache.length + 1)
        bucket = graphs.bucket_for(rows_s)
        assert bucket is not None and bucket.lora == passes
        want = _host(model.logits(model.forward(np.asarray(tokens), BatchLayout(rows_e))))
        got = _host(graphs.run(tokens, rows_s, bucket))
        _assert_same_logits(got, want, engine.device)
        tokens = [int(t) for t in want.argmax(axis=1)]
    for cache in eager + static:
        cache.release()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_lora_rows_in_every_batch_bucket_give_the_eager_logits(models, device: str, arch: str):
    """1, 3, 6 and 12 rows (buckets 1, 4, 8 and 16: padding rows in three) of the mixed
    stacks, at both table widths."""
    engine = _engine(models[arch], device, max_sequences=16)
    mix = _stacks(engine)
    rng = np.random.default_rng(1)
    for rows, longest in [(1, 20), (3, 300), (6, 40), (12, 280)]:
        lengths = [longest, *rng.integers(1, longest, rows - 1)]
        prompts = [rng.integers(3, 250, int(n)).tolist() for n in lengths]
        stacks = [mix[(i + rows) % len(mix)] for i in range(rows)]
        _side_by_side(engine, prompts, stacks, steps=3)
    assert engine.decode_graphs.describe()["lora graphs"] == (4 if device != "cpu" else 0)


def test_the_gpus_product_gives_the_eager_logits_where_a_batch_fills_its_bucket(models):
    """The GPU's product (two GEMMs over every slot) on the CPU: torch's CPU GEMM rounds by
    the number of rows, so the eager step matches where it has the bucket's rows."""
    engine = _engine(models["llama"], "cpu", max_sequences=8)
    engine.model.ops.lora_slots.product = gemm_delta
    mix = _stacks(engine)
    rng = np.random.default_rng(2)
    for rows in (1, 2, 4, 8):
        prompts = [rng.integers(3, 250, int(rng.integers(1, 30))).tolist() for _ in range(rows)]
        stacks = [mix[(i + 1) % len(mix)] for i in range(rows)]
        _side_by_side(engine, prompts, stacks, steps=2)


def _generate(engine: Engine, requests: list[tuple[str, list[int], tuple]], steps: list):
    """Greedy tokens and logprobs of each request, all in one generator; `steps` gets each
    decode step's bucket (None: the eager step)."""
    generator = engine.new_generator()
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=3, ignore_eos=True)
    for request_id, prompt, stack in requests:
        generator.add(request_id, prompt, params, adapters=stack)
    graphs = engine.decode_graphs
    bucket_for = graphs.bucket_for
    graphs.bucket_for = lambda chunks: steps.append(bucket_for(chunks)) or steps[-1]
    out: dict[str, list] = {request_id: [] for request_id, _, _ in requests}
    try:
        while len(generator):
            for e in generator.step():
                out[e.request_id].append((e.token_id, e.logprob, e.top_logprobs))
    finally:
        del graphs.bucket_for
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_lora_row_gives_its_answer_alone_in_batches(models, device: str, arch: str):
    """Each stack's request alone, then beside 1, 8 and 31 mates of mixed stacks: the same
    tokens and logprobs, with the decode steps in LoRA buckets. Alone, scale 0.0 answers
    as no adapter does, and each adapter changes the answer."""
    engine = _engine(models[arch], device, max_sequences=32)
    mix = _stacks(engine)
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 250, 11).tolist()
    probes = [(f"probe{i}", prompt, stack) for i, stack in enumerate(mix)]
    alone = {}
    for probe in probes:
        alone |= _generate(engine, [probe], [])
    assert alone["probe2"] == alone["probe0"]  # (a, 0.0) adds exact zeros
    others = [alone[f"probe{i}"] for i in (0, 1, 3, 4, 5)]
    assert all(x != y for i, x in enumerate(others) for y in others[i + 1 :])
    # the two-adapter stack beside one mate; then every stack among mates
    for size, chosen in ((2, probes[4:5]), (9, probes[1:]), (32, probes)):
        mates = [
            (f"mate{i}", rng.integers(3, 250, int(rng.integers(2, 30))).tolist(), mix[i % 6])
            for i in range(size - len(chosen))
        ]
        steps: list = []
        batched = _generate(engine, [*mates[: size // 2], *chosen, *mates[size // 2 :]], steps)
        assert len(batched) == size
        for request_id, _, _ in chosen:
            _assert_same_answer(batched[request_id], alone[request_id], device)
        assert any(b is not None and b.lora for b in steps)


def test_overlapped_lora_steps_give_the_step_by_step_tokens(models):
    """LoRA steps launched from the last step's tokens still on the device (runtime/
    generator.py's overlap) give the tokens of the step-by-step loop."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 250, int(n)).tolist() for n in rng.integers(2, 30, 7)]
    tokens = {}
    for overlap in (False, True):
        engine = _engine(models["llama"], "cpu", max_sequences=8, overlap=overlap)
        mix = _stacks(engine)
        generator = engine.new_generator()
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            generator.add(f"r{i}", prompt, params, adapters=mix[i % len(mix)])
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while len(generator):
            for e in generator.step():
                out[e.request_id].append(e.token_id)
        assert (generator.overlapped_steps > 0) == overlap
        assert engine.decode_graphs.last_bucket.lora == 2
        tokens[overlap] = out
    assert tokens[True] == tokens[False]


def test_slots_reused_over_time_keep_each_answer(models, device: str):
    """Five adapters through two slots, each request alone in turn, twice round: every
    answer as the first time (and as with eight slots)."""
    files = models["llama"]
    names = [f"c{i}" for i in range(5)]
    prompt = list(range(5, 20))
    answers = {}
    for slots in (8, 2):
        engine = _engine(files, device, adapters=names, lora_slots=slots, max_sequences=4)
        for name in names + names[::-1]:
            stack = engine.adapter_stack([(name, 1.5)])
            got = _generate(engine, [(name, prompt, stack)], [])[name]
            assert answers.setdefault(name, got) == got
        if slots == 2:
            assert engine.lora_slots.placements == 8  # c0 .. c4, then c2, c1, c0 again


def test_a_step_with_more_adapters_than_slots_runs_eagerly(models, device: str):
    """Three adapters on two slots: the decode steps take the eager step (RowAdapters) and
    each request still gets its answer alone (the bits on the CPU, where `RowAdapters`
    adds each row alone too; the tokens on a GPU)."""
    files = models["llama"]
    names = ["c0", "c1", "c2"]
    engine = _engine(files, device, adapters=names, lora_slots=2, max_sequences=4)
    requests = [(n, [7, 8, 9 + i], engine.adapter_stack([(n, 1.0)])) for i, n in enumerate(names)]
    alone = {}
    for request in requests:
        alone |= _generate(engine, [request], [])
    steps: list = []
    together = _generate(engine, requests, steps)
    assert steps and all(bucket is None for bucket in steps)
    for name in names:
        if device == "cpu":
            _assert_same_answer(together[name], alone[name], device)
        else:
            assert [t for t, *_ in together[name]] == [t for t, *_ in alone[name]]


def test_an_adapter_above_the_slots_rank_runs_eagerly(models):
    """Rank 8 on q and v fuses into 16 in the q/k/v weight: slots of rank 8 refuse it."""
    engine = _engine(models["llama"], "cpu", lora_rank=8, max_sequences=4)
    stack = engine.adapter_stack([("a", 1.0)])
    assert not engine.lora_slots.fits(stack[0][0])
    cache = engine.model.new_cache(4, pool=engine.kv_pool)
    assert engine.decode_graphs.bucket_for([SequenceChunk(cache, 0, 1, stack)]) is None
    cache.release()
    steps: list = []
    got = _generate(engine, [("r", [4, 5, 6], stack)], steps)["r"]
    assert len(got) == 5 and all(bucket is None for bucket in steps)


@pytest.mark.parametrize("product", [gemm_delta, rows_delta], ids=["gemm", "rows"])
def test_slot_deltas_match_the_float32_reference(models, product):
    """Each row's delta from the slots, for rows of every stack, against `x @ A.T * s @ B.T`
    per adapter in float64; the CPU's product gives `RowAdapters`' bits."""
    engine = _engine(models["llama"], "cpu")
    stacks = _stacks(engine)
    slots = LoraSlots(engine.model, slots=3, rank=32)
    slot_of = slots.place(stacks)
    coef = np.zeros((2, len(stacks), 3), np.float32)
    for row, stack in enumerate(stacks):
        for j, (adapter, scale) in enumerate(stack):
            coef[j, row, slot_of[adapter.key]] = scale
    rng = np.random.default_rng(4)
    layer = engine.model.layers[1]
    for weight in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down):
        out_dim, in_dim = weight.shape
        x = torch.from_numpy(rng.standard_normal((len(stacks), in_dim), np.float32))
        base = torch.from_numpy(rng.standard_normal((len(stacks), out_dim), np.float32))
        want = base.double().clone()
        for row, stack in enumerate(stacks):
            for adapter, scale in stack:
                delta = adapter.deltas.get(id(weight))
                if delta is not None:
                    a, b = torch.from_numpy(delta.a).double(), torch.from_numpy(delta.b).double()
                    want[row] += (x[row].double() @ a.T * scale) @ b.T
        sw = slots.weights[id(weight)]
        got = product(x, base.clone(), sw, torch.from_numpy(coef), slots.rank)
        np.testing.assert_allclose(got.double().numpy(), want.numpy(), rtol=0, atol=1e-5)
        if product is rows_delta:
            spans = [(row, row + 1, stack) for row, stack in enumerate(stacks)]
            row_adapters = RowAdapters.for_spans(spans)
            assert torch.equal(got, row_adapters.apply(weight, x, base.clone()))


def test_describe_reports_slots_and_lora_graphs(models):
    engine = _engine(models["llama"], "cpu", max_sequences=4, lora_slots=3, lora_rank=16)
    described = engine.decode_graphs.describe()
    assert described["lora slots"] == {
        "slots": 3,
        "rank": 16,
        "resident": 0,
        "placements": 0,
        "bytes": 0,  # allocated at the first adapter placed
    }
    _generate(engine, [("r", [4, 5, 6], engine.adapter_stack([("a", 1.0)]))], [])
    slots = engine.decode_graphs.describe()["lora slots"]
    assert slots["resident"] == 1 and slots["bytes"] > 0
    assert engine.decode_graphs.describe()["lora graphs"] == 0  # nothing captured on a CPU
