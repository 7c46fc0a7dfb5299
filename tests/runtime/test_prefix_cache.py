"""The prefix cache: lookups by token chain, eviction, windowed layers, and exact output
from cached blocks."""

from __future__ import annotations

from runtime.engine import Engine
from runtime.kv_pool import BlockPool
from runtime.prefix_cache import PrefixCache
from runtime.sampling import SamplingParams
from tests.runtime.generation_helpers import GREEDY, random_tokens, run_all


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


def test_cached_prefix_gives_exactly_the_cold_output(tiny_model_path):
    engine = Engine.load(str(tiny_model_path))
    system = random_tokens(50, seed=2, vocab=engine.model.vocab_size)
    first = system + random_tokens(5, seed=3, vocab=engine.model.vocab_size)
    second = system + random_tokens(7, seed=4, vocab=engine.model.vocab_size)
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
    prompt = random_tokens(40, seed=5, vocab=engine.model.vocab_size)
    params = SamplingParams(max_tokens=3, **GREEDY)
    list(engine.generate(prompt, params))
    generator = engine.new_generator()
    out = run_all(generator, {"x": (prompt, params)}, x={"cache_prompt": False})
    assert out["x"][0].cached_tokens == 0
