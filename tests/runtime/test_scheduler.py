"""Paged KV memory, the prefix cache and the continuous-batching scheduler on tiny models."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtime.engine import Engine, EngineConfig
from runtime.kv_cache import KVCache
from runtime.kv_pool import BLOCK_SIZE, BlockPool, OutOfBlocksError, PagedKVCache
from runtime.models.base import BatchLayout, SequenceChunk
from runtime.prefix_cache import PrefixCache
from runtime.sampling import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
TOL = dict(rtol=1e-4, atol=1e-4)


def _tokens(n: int, seed: int, vocab: int = 250) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, vocab, n)]


def _run_all(batch, requests: dict[str, tuple[list[int], SamplingParams]], **add) -> dict:
    out: dict[str, list] = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        batch.add(rid, prompt, params, **add.get(rid, {}))
    while len(batch):
        for event in batch.step():
            out[event.request_id].append(event)
    return out


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> Engine:
    return Engine.load(str(tiny_model_path))


def test_pool_hands_out_consecutive_blocks_and_counts_references():
    pool = BlockPool(n_layers=1, n_kv_heads=1, head_dim=2, n_blocks=4)
    a = pool.allocate()
    b = pool.allocate(after=a)
    assert (a, b) == (0, 1) and pool.n_free == 2
    pool.retain([a])
    pool.release([a, b])
    assert pool.n_free == 3 and pool.refcount[a] == 1
    pool.release([a])
    assert pool.n_free == 4
    for _ in range(4):
        pool.allocate()
    with pytest.raises(OutOfBlocksError):
        pool.allocate()


def test_new_runs_start_mid_gap_so_sequences_decoding_in_step_stay_consecutive():
    pool = BlockPool(n_layers=1, n_kv_heads=1, head_dim=2, n_blocks=64)
    caches = [PagedKVCache(pool) for _ in range(4)]
    for cache in caches:
        cache.reserve(BLOCK_SIZE)
    # the first opens the pool; each next one halves the largest gap
    assert [c.tables[0][0] for c in caches] == [0, 32, 16, 48]
    for tokens in range(2 * BLOCK_SIZE, 16 * BLOCK_SIZE + 1, BLOCK_SIZE):
        for cache in caches:  # one block each per round, as a decode batch grows them
            cache.reserve(tokens)
    assert [len(c.runs(0, c.capacity)) for c in caches] == [1, 1, 1, 1]
    assert pool.n_free == 0
    caches[1].release()
    caches[0].reserve(17 * BLOCK_SIZE)  # block 16 is taken: a new run mid the freed 32..47
    assert caches[0].tables[0][-1] == 40 and len(caches[0].runs(0, caches[0].capacity)) == 2
    for cache in caches:
        cache.release()
    assert pool.n_free == 64 and not pool.refcount.any()


def test_paged_cache_equals_contiguous_cache_even_when_fragmented(engine):
    model = engine.model
    pool = BlockPool(*model.kv_shape, n_blocks=16)
    blockers = [pool.allocate() for _ in range(3)]
    paged = PagedKVCache(pool)
    paged.reserve(BLOCK_SIZE)
    # the block right after it taken: the next block of `paged` cannot be consecutive
    blockers.append(pool.allocate(after=paged.tables[0][-1]))
    tokens = np.asarray(_tokens(40, seed=1, vocab=model.vocab_size))
    contiguous = KVCache(*model.kv_shape, 64)
    expected = model.logits(model.forward(tokens, BatchLayout([SequenceChunk(contiguous, 0, 40)])))
    paged.reserve(30)
    got = model.logits(model.forward(tokens[:30], BatchLayout([SequenceChunk(paged, 0, 30)])))
    assert len(paged.runs(0, 30)) == 2  # the table really is fragmented
    for pos in range(30, 40):
        paged.reserve(pos + 1)
        hidden = model.forward(tokens[pos : pos + 1], BatchLayout([SequenceChunk(paged, pos, 1)]))
        got = np.concatenate([got, model.logits(hidden)])
    np.testing.assert_allclose(got, expected, **TOL)
    assert paged.nbytes == 3 * pool.block_nbytes
    paged.release()
    pool.release(blockers)
    assert pool.n_free == 16


def test_prefix_cache_finds_the_longest_cached_prefix():
    pool = BlockPool(n_layers=1, n_kv_heads=1, head_dim=2, n_blocks=8)
    cache = PrefixCache(pool, "m")
    prompt = list(range(50))
    blocks = [pool.allocate() for _ in range(4)]
    entries = [(b,) for b in blocks]  # one layer group: one block per entry
    cache.insert(prompt, entries)  # 3 full blocks of 16 are cached
    assert len(cache) == 3 and all(pool.refcount[b] == 2 for b in blocks[:3])
    assert cache.lookup(prompt) == entries[:3]
    assert cache.lookup(prompt[:40] + [999] * 10) == entries[:2]
    assert cache.lookup([1] + prompt[1:]) == []  # the chain depends on every earlier token
    assert cache.lookup(prompt[:32]) == entries[:1]  # the last position is always computed
    assert PrefixCache(pool, "other-model").lookup(prompt) == []
    pool.release(blocks)  # the sequence is done: only the cache holds them now
    assert cache.evict(2) == 2 and len(cache) == 1


def test_prefix_cache_never_evicts_blocks_in_use():
    pool = BlockPool(n_layers=1, n_kv_heads=1, head_dim=2, n_blocks=4)
    cache = PrefixCache(pool, "m")
    blocks = [pool.allocate(), pool.allocate()]
    cache.insert(list(range(32)), [(b,) for b in blocks])
    assert cache.evict(10) == 0  # the sequence still holds them
    pool.release(blocks[:1])
    assert cache.evict(10) == 1 and pool.refcount[blocks[1]] == 2


def test_cached_prefix_gives_exactly_the_cold_output(tiny_model_path):
    engine = Engine.load(str(tiny_model_path))
    system = _tokens(50, seed=2, vocab=engine.model.vocab_size)
    first = system + _tokens(5, seed=3, vocab=engine.model.vocab_size)
    second = system + _tokens(7, seed=4, vocab=engine.model.vocab_size)
    params = SamplingParams(max_tokens=12, **GREEDY)
    cold = [e.token_id for e in engine.generate(second, params)]
    engine.prefix_cache.clear()
    list(engine.generate(first, params))  # fills the cache with the system prompt's blocks
    events = list(engine.generate(second, params))
    assert events[0].cached_tokens == 48  # three full blocks of the shared 50 tokens
    assert [e.token_id for e in events] == cold
    stats = engine.prefix_cache.stats
    assert stats.cached_tokens >= 48 and 0 < stats.hit_rate < 1


def test_cache_prompt_false_bypasses_the_prefix_cache(tiny_model_path):
    engine = Engine.load(str(tiny_model_path))
    prompt = _tokens(40, seed=5, vocab=engine.model.vocab_size)
    params = SamplingParams(max_tokens=3, **GREEDY)
    list(engine.generate(prompt, params))
    batch = engine.new_batch()
    out = _run_all(batch, {"x": (prompt, params)}, x={"cache_prompt": False})
    assert out["x"][0].cached_tokens == 0


def test_preemption_when_kv_memory_runs_out_keeps_every_output_exact(tiny_model_path):
    roomy = Engine.load(str(tiny_model_path))
    requests = {
        f"r{i}": (_tokens(20 + 3 * i, seed=10 + i), SamplingParams(max_tokens=30, **GREEDY))
        for i in range(4)
    }
    expected = _run_all(roomy.new_batch(), requests)
    tight = Engine.load(str(tiny_model_path))
    # 12 blocks = 192 tokens: not enough for four sequences of ~50-60 tokens at once
    tight.kv_pool = BlockPool(*tight.model.kv_shape, n_blocks=12)
    tight.prefix_cache = PrefixCache(tight.kv_pool, "tight")
    batch = tight.new_batch()
    got = _run_all(batch, requests)
    assert batch.preemptions > 0
    for rid in requests:
        assert [e.token_id for e in got[rid]] == [e.token_id for e in expected[rid]]
        assert [e.index for e in got[rid]] == list(range(30))
    assert tight.kv_pool.n_free + sum(1 for b in range(12) if tight.kv_pool.refcount[b] > 0) == 12


def test_interactive_requests_go_before_batch_requests(engine):
    engine_batch = engine.new_batch()
    engine_batch.config.max_batch = 1
    params = SamplingParams(max_tokens=2, **GREEDY)
    order: list[str] = []
    engine_batch.add("batch-1", [20, 21], params, priority=1)
    engine_batch.add("batch-2", [20, 22], params, priority=1)
    engine_batch.add("chat", [20, 23], params, priority=0)
    while len(engine_batch):
        for event in engine_batch.step():
            if event.finish_reason:
                order.append(event.request_id)
    assert order == ["chat", "batch-1", "batch-2"]


def test_kv_memory_grows_with_tokens_in_use(engine):
    batch = engine.new_batch()
    pool = engine.kv_pool
    before = pool.bytes_in_use
    batch.add(
        "a", _tokens(40, seed=6), SamplingParams(max_tokens=100, **GREEDY), cache_prompt=False
    )
    batch.step()
    # 40 positions -> 3 blocks of 16, not 140; sliding-window layers keep only their window
    assert pool.bytes_in_use - before == _kv_bytes(pool, 40, blocks=3)
    for _ in range(20):
        batch.step()
    assert pool.bytes_in_use - before == _kv_bytes(pool, 60, blocks=4)
    batch.abort("a")
    assert pool.bytes_in_use == before


def _kv_bytes(pool, length: int, blocks: int) -> int:
    """KV bytes of one sequence of `length` written positions in `blocks` blocks: every
    windowed layer group has given back the blocks wholly before its window."""
    total = 0
    for group, layers in enumerate(pool.groups):
        dead = 0 if layers.window is None else max(0, length + 1 - layers.window) // 16
        total += (blocks - dead) * pool.group_nbytes(group)
    return total


def test_sliding_window_layers_keep_only_their_window(tiny_gemma3_path):
    """gemma3: local layers (window 8 in the tiny model) hold at most two blocks while the
    global layers' table grows with the sequence; output equals the contiguous cache's."""
    engine = Engine.load(str(tiny_gemma3_path))
    pool = engine.kv_pool
    assert [g.window for g in pool.groups] == [None, 8]
    prompt = _tokens(37, seed=8, vocab=engine.model.vocab_size)
    params = SamplingParams(max_tokens=40, **GREEDY)
    batch = engine.new_batch()
    batch.add("a", prompt, params, cache_prompt=False)
    seq = batch._waiting[0]
    tokens, held = [], []
    while len(batch):
        tokens += [e.token_id for e in batch.step()]
        if seq.cache is not None and seq.cache.tables[0]:  # until it finished
            held.append([sum(b is not None for b in table) for table in seq.cache.tables])
    assert max(local for _, local in held) <= 2 and held[-1][0] == -(-(37 + 39) // 16)
    cache = engine.model.new_cache(80)  # reference: contiguous cache, nothing freed
    ids = list(prompt)
    expected = []
    for _ in range(40):
        start = cache.length
        chunk = np.asarray(ids[start:])
        hidden = engine.model.forward(chunk, BatchLayout([SequenceChunk(cache, start, len(chunk))]))
        expected.append(int(engine.model.logits(hidden[-1:])[0].argmax()))
        ids.append(expected[-1])
    assert tokens == expected


def test_step_token_budget_bounds_prefill(tiny_llama_path):
    engine = Engine.load(str(tiny_llama_path), EngineConfig(prefill_chunk=10))
    batch = engine.new_batch()
    batch.add("long", _tokens(35, seed=7), SamplingParams(max_tokens=1, **GREEDY))
    steps = 0
    while len(batch):
        batch.step()
        steps += 1
    assert steps == 4  # 35 prompt tokens in chunks of at most 10


def test_pool_memory_is_resident_only_where_blocks_were_written():
    psutil = pytest.importorskip("psutil")
    process = psutil.Process()
    before = process.memory_info().rss
    pool = BlockPool(n_layers=30, n_kv_heads=3, head_dim=64, n_blocks=10_000)  # ~7 GiB mapped
    cache = PagedKVCache(pool)
    cache.reserve(BLOCK_SIZE)
    slot = cache.slot_ids(0, 1)
    for layer in range(30):  # one token written to every layer, as attention stores it
        pool.keys[layer][:, slot] = 1.0
        pool.values[layer][:, slot] = 1.0
    grown = process.memory_info().rss - before
    assert grown < 64 * 2**20, f"writing one token made {grown / 2**20:.0f} MiB resident"


def test_prefix_cache_needs_the_whole_window_of_windowed_layers():
    """An entry's windowed block may be gone (its sequence moved past it): a prefix is
    usable only where the blocks a query right after it can see are all there."""
    pool = BlockPool(n_layers=2, n_kv_heads=1, head_dim=2, n_blocks=16, windows=[None, 20])
    cache = PrefixCache(pool, "m")
    prompt = list(range(70))
    full = [pool.allocate() for _ in range(4)]
    local = [pool.allocate(group=1) for _ in range(2)]
    # blocks 0 and 1 of the windowed layer were given back; 2 and 3 are held
    cache.insert(
        prompt, [(full[0], None), (full[1], None), (full[2], local[0]), (full[3], local[1])]
    )
    # after 4 blocks (64 positions) a query sees positions 45.. = blocks 2 and 3: usable
    assert [entry[0] for entry in cache.lookup(prompt)] == full
    # after 3 blocks it would need block 1 (positions 29..47): not there, nor for 2 or 1
    assert cache.lookup(prompt[:49]) == []
    assert pool.groups[1].refcount[local[0]] == 2 and pool.refcount[full[0]] == 2
    pool.release(full)
    pool.release(local, group=1)
    assert cache.evict(10) == 4 and pool.n_free == 16 and pool.groups[1].n_free == 16
