"""Paged KV memory: the block pool, a sequence's block table, what is resident, and
sliding-window layers giving their blocks back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtime.engine import Engine
from runtime.kv_pool import BLOCK_SIZE, BlockPool, OutOfBlocksError, PagedKVCache
from runtime.models.base import BatchLayout, SequenceChunk
from runtime.sampling import SamplingParams
from tests.runtime.generation_helpers import GREEDY, TOL, random_tokens


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
    ops = model.ops  # the model's own element type, every layer in one group
    pool = BlockPool(*model.kv_shape, 16, storage=ops.kv_storage, value_bytes=ops.kv_value_bytes)
    blockers = [pool.allocate() for _ in range(3)]
    paged = PagedKVCache(pool)
    paged.reserve(BLOCK_SIZE)
    # the block right after it taken: the next block of `paged` cannot be consecutive
    blockers.append(pool.allocate(after=paged.tables[0][-1]))
    tokens = np.asarray(random_tokens(40, seed=1, vocab=model.vocab_size))
    contiguous = model.new_cache(64)  # a pool of its own: one run of blocks
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


def test_kv_memory_grows_with_tokens_in_use(engine):
    generator = engine.new_generator()
    pool = engine.kv_pool
    before = pool.bytes_in_use
    generator.add(
        "a", random_tokens(40, seed=6), SamplingParams(max_tokens=100, **GREEDY), cache_prompt=False
    )
    generator.step()
    # 40 positions -> 3 blocks of 16, not 140; sliding-window layers keep only their window
    assert pool.bytes_in_use - before == _kv_bytes(pool, 40, blocks=3)
    for _ in range(20):
        generator.step()
    assert pool.bytes_in_use - before == _kv_bytes(pool, 60, blocks=4)
    generator.abort("a")
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
    prompt = random_tokens(37, seed=8, vocab=engine.model.vocab_size)
    params = SamplingParams(max_tokens=40, **GREEDY)
    generator = engine.new_generator()
    generator.add("a", prompt, params, cache_prompt=False)
    seq = generator._waiting[0]
    tokens, held = [], []
    while len(generator):
        tokens += [e.token_id for e in generator.step()]
        if seq.cache is not None and seq.cache.tables[0]:  # until it finished
            held.append([sum(b is not None for b in table) for table in seq.cache.tables])
    assert max(local for _, local in held) <= 2 and held[-1][0] == -(-(37 + 39) // 16)
    cache = engine.model.new_cache(80)  # reference: a pool of its own, one run of blocks
    ids = list(prompt)
    expected = []
    for _ in range(40):
        start = cache.length
        chunk = np.asarray(ids[start:])
        hidden = engine.model.forward(chunk, BatchLayout([SequenceChunk(cache, start, len(chunk))]))
        expected.append(int(engine.model.logits(hidden[-1:])[0].argmax()))
        ids.append(expected[-1])
    assert tokens == expected


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
