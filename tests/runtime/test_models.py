"""Forward-pass invariants on tiny random models: caching, batching and chunking must not
change the numbers, and attention must mask exactly what it should."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from runtime.errors import ModelFormatError
from runtime.gguf_file import GGUFFile
from runtime.kernels import get_backend
from runtime.kv_pool import BlockPool, PagedKVCache, lazy_array
from runtime.models import ARCHITECTURES, load_model
from runtime.models.attention import attend, attend_layout
from runtime.models.base import BatchLayout, SequenceChunk
from runtime.models.llama import unpermute_rows

TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def model(tiny_model_path: Path):
    return load_model(GGUFFile(tiny_model_path), get_backend("numpy"))


def _tokens(model, n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, model.vocab_size, n)


def _full_logits(model, tokens: np.ndarray) -> np.ndarray:
    cache = model.new_cache(len(tokens))
    hidden = model.forward(tokens, BatchLayout([SequenceChunk(cache, 0, len(tokens))]))
    return model.logits(hidden)  # [n, V]


def test_cached_decode_equals_full_recompute(model):
    tokens = _tokens(model, 24, seed=1)
    full = _full_logits(model, tokens)
    cache = model.new_cache(len(tokens))
    model.forward(tokens[:5], BatchLayout([SequenceChunk(cache, 0, 5)]))
    for pos in range(5, len(tokens)):
        hidden = model.forward(tokens[pos : pos + 1], BatchLayout([SequenceChunk(cache, pos, 1)]))
        np.testing.assert_allclose(model.logits(hidden)[0], full[pos], **TOL)
    assert cache.length == len(tokens)


def test_chunked_prefill_equals_one_pass(model):
    tokens = _tokens(model, 30, seed=2)
    full = _full_logits(model, tokens)
    cache = model.new_cache(len(tokens))
    for start in range(0, 30, 7):
        n = min(7, 30 - start)
        hidden = model.forward(
            tokens[start : start + n], BatchLayout([SequenceChunk(cache, start, n)])
        )
        np.testing.assert_allclose(model.logits(hidden), full[start : start + n], **TOL)


def test_batched_sequences_at_different_positions_equal_one_by_one(model):
    prompts = [_tokens(model, n, seed=10 + n) for n in (3, 17, 9)]
    expected = [_full_logits(model, p) for p in prompts]
    pool = model.new_kv_pool(3 * 32)  # one forward pass attends over one pool
    caches = [model.new_cache(20, pool) for _ in prompts]
    # step 1: the first two prefill everything but their last token, the third only 4 tokens
    first = [len(prompts[0]) - 1, len(prompts[1]) - 1, 4]
    tokens = np.concatenate([p[:n] for p, n in zip(prompts, first, strict=True)])
    chunks = [SequenceChunk(c, 0, n) for c, n in zip(caches, first, strict=True)]
    hidden = model.forward(tokens, BatchLayout(chunks))
    np.testing.assert_allclose(model.logits(hidden[: first[0]]), expected[0][: first[0]], **TOL)
    # step 2: two single-token decodes mixed with the rest of the third prompt
    tokens = np.concatenate([prompts[0][-1:], prompts[1][-1:], prompts[2][4:]])
    chunks = [
        SequenceChunk(caches[0], first[0], 1),
        SequenceChunk(caches[1], first[1], 1),
        SequenceChunk(caches[2], 4, len(prompts[2]) - 4),
    ]
    logits = model.logits(model.forward(tokens, BatchLayout(chunks)))
    np.testing.assert_allclose(logits[0], expected[0][-1], **TOL)
    np.testing.assert_allclose(logits[1], expected[1][-1], **TOL)
    np.testing.assert_allclose(logits[2:], expected[2][4:], **TOL)


def _naive_attention(q, keys, values, start, scale, window, softcap=None, sinks=None):
    """`sinks` [H]: one more logit in each head's softmax, weighing no value (gpt-oss)."""
    n, n_heads, head_dim = q.shape
    n_kv = keys.shape[0]
    out = np.zeros((n, n_heads, head_dim))
    for i in range(n):
        pos = start + i
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            visible = [j for j in range(pos + 1) if window is None or pos - j < window]
            scores = np.array([q[i, h] @ keys[kv, j] * scale for j in visible])
            if softcap is not None:
                scores = softcap * np.tanh(scores / softcap)
            if sinks is not None:
                scores = np.append(scores, sinks[h])
            weights = np.exp(scores - scores.max())
            weights = (weights / weights.sum())[: len(visible)]
            out[i, h] = sum(w * values[kv, j] for w, j in zip(weights, visible, strict=True))
    return out.reshape(n, n_heads * head_dim)


@pytest.mark.parametrize("window", [None, 1, 3, 6])
@pytest.mark.parametrize(("start", "n"), [(0, 9), (5, 4), (11, 1)])
def test_attend_matches_naive_causal_windowed_gqa(window, start, n):
    rng = np.random.default_rng(start * 100 + n)
    q = rng.standard_normal((n, 6, 8)).astype(np.float32)
    keys = rng.standard_normal((2, start + n, 8)).astype(np.float32)
    values = rng.standard_normal((2, start + n, 8)).astype(np.float32)
    got = attend(q * 0.35, [(keys.transpose(0, 2, 1), values)], start, window)
    np.testing.assert_allclose(got, _naive_attention(q, keys, values, start, 0.35, window), **TOL)


@pytest.mark.parametrize("window", [None, 2, 7])
@pytest.mark.parametrize(("start", "n"), [(0, 9), (10, 3), (12, 1)])
def test_attend_over_several_segments_equals_one(window, start, n):
    rng = np.random.default_rng(start + n)
    q = rng.standard_normal((n, 4, 8)).astype(np.float32)
    keys_t = rng.standard_normal((2, 8, start + n)).astype(np.float32)
    values = rng.standard_normal((2, start + n, 8)).astype(np.float32)
    whole = attend(q, [(keys_t, values)], start, window)
    cuts = [0, 3, 5, start + n] if start + n > 5 else [0, start + n]
    segments = [(keys_t[:, :, a:b], values[:, a:b]) for a, b in itertools.pairwise(cuts)]
    np.testing.assert_allclose(attend(q, segments, start, window), whole, **TOL)


def test_gemma3_sliding_window_changes_only_local_layers(tiny_gemma3_path):
    model = load_model(GGUFFile(tiny_gemma3_path), get_backend("numpy"))
    windows = [layer.window for layer in model.layers]
    assert windows == [8, 8, 8, 8, 8, None]  # every 6th layer is global
    tokens = np.arange(20) % model.vocab_size
    with_window = _full_logits(model, tokens)
    for layer in model.layers:
        layer.window = None
    without = _full_logits(model, tokens)
    np.testing.assert_allclose(with_window[:8], without[:8], **TOL)  # inside the window: same
    assert np.abs(with_window[8:] - without[8:]).max() > 1e-3  # beyond it: the mask matters


def test_unpermute_rows_pairs_adjacent_rows_into_halves():
    n_heads, head_dim = 2, 4
    rows = np.arange(n_heads * head_dim, dtype=np.float32)[:, None]  # row index as value
    out = unpermute_rows(rows, n_heads)[:, 0]
    # per head, GGUF rows (0,1),(2,3) -> HF rows (0,2),(1,3)
    assert out.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_loaded_weights_match_the_file(tiny_llama_path):
    f = GGUFFile(tiny_llama_path)
    model = load_model(f, get_backend("numpy"))
    down = f.tensor("blk.1.ffn_down.weight")  # [out, in]
    np.testing.assert_array_equal(model.layers[1].w_down.array, down)
    gate = f.tensor("blk.1.ffn_gate.weight")  # the norm weight is folded into its columns
    norm = f.tensor("blk.1.ffn_norm.weight")
    np.testing.assert_allclose(model.layers[1].w_gate_up.array[:96], gate * norm[None, :])
    assert model.embed.shape == (model.vocab_size, 64)
    assert model.nbytes > 0


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    import gguf

    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_tensor("x", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    supported = ", ".join(sorted(ARCHITECTURES))
    with pytest.raises(ModelFormatError, match="architecture 'mamba' is not supported") as err:
        load_model(GGUFFile(path))
    assert f"(supported: {supported})" in str(err.value)


def test_tensor_type_without_dequantizer_is_a_clear_error(tmp_path):
    from tests.tiny_models import write_tiny_llama

    path = write_tiny_llama(tmp_path / "int.gguf", int_embeddings=True)
    with pytest.raises(ModelFormatError, match="'token_embd.weight' has type I32"):
        load_model(GGUFFile(path))


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        GGUFFile(path)


def test_truncated_file_is_a_clear_error(tmp_path, tiny_llama_path):
    data = tiny_llama_path.read_bytes()
    for cut in (100, len(data) // 2, len(data) - 10):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelFormatError):
            load_model(GGUFFile(path))


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ModelFormatError, match="no such file"):
        GGUFFile(tmp_path / "absent.gguf")


@pytest.fixture(params=["kernel", "numpy"])
def attention_path(request, monkeypatch):
    """Attention through the C kernel, or numpy's path (where no compiler builds it)."""
    from runtime.kernels.native import paged_attention
    from runtime.models import attention

    if request.param == "numpy":
        monkeypatch.setattr(attention, "paged_attention", lambda *_: None)
    elif paged_attention() is None:
        pytest.skip("no C compiler: the kernel is not built here")
    return request.param


@pytest.mark.parametrize(("softcap", "with_sinks"), [(None, False), (2.0, False), (None, True)])
@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_batch_attention_matches_naive_per_sequence(
    window, kv_dtype, softcap, with_sinks, attention_path
):
    """The pooled path: fragmented block tables (several runs per sequence), decode rows of
    very different lengths (several padded groups on numpy's path) mixed with a prefill
    chunk; over a float32 pool and over a half one (`KernelPlan.kv`), whose keys are the
    reference's rounded to half; with Gemma 2's cap on the scores too, or gpt-oss's sinks
    (some above every score, some below)."""
    n_kv, n_heads, head_dim, block = 2, 6, 8, 4
    pool = BlockPool(
        1,
        n_kv,
        head_dim,
        n_blocks=64,
        block_size=block,
        storage=lambda h, t, d: lazy_array((h, t, d), kv_dtype),
    )
    rng = np.random.default_rng(7)
    lengths = [2, 3, 9, 14, 30]  # tokens each sequence will hold
    caches = [PagedKVCache(pool) for _ in lengths]
    for upto in range(block, max(lengths) + block, block):
        for cache, length in zip(caches, lengths, strict=True):
            cache.reserve(min(upto, length))
            last = cache.tables[0][-1]
            if last + 1 < pool.n_blocks and pool.refcount[last + 1] == 0:
                pool.allocate(after=last)  # taken: the cache's next block starts a new run
    assert any(len(cache.runs(0, cache.capacity)) > 1 for cache in caches)
    keys = [rng.standard_normal((n, n_kv, head_dim)).astype(np.float32) for n in lengths]
    values = [rng.standard_normal((n, n_kv, head_dim)).astype(np.float32) for n in lengths]
    queries = [rng.standard_normal((n, n_heads, head_dim)).astype(np.float32) for n in lengths]
    sinks = (4 * rng.standard_normal(n_heads)).astype(np.float32) if with_sinks else None

    def step(spans: list[tuple[int, int]]) -> None:
        """One batched call: sequence i gets positions spans[i] = (start, end)."""
        chunks = [SequenceChunk(c, a, b - a) for c, (a, b) in zip(caches, spans, strict=True)]
        pick = [(i, slice(a, b)) for i, (a, b) in enumerate(spans)]
        got = attend_layout(
            0,
            np.concatenate([queries[i][s] for i, s in pick]),
            np.concatenate([keys[i][s] for i, s in pick]),
            np.concatenate([values[i][s] for i, s in pick]),
            BatchLayout(chunks),
            window,
            softcap,
            sinks,
        )
        row = 0
        for i, s in pick:
            k_all, v_all = (
                keys[i][: s.stop].transpose(1, 0, 2).astype(kv_dtype).astype(np.float32),
                values[i][: s.stop].transpose(1, 0, 2).astype(kv_dtype).astype(np.float32),
            )
            want = _naive_attention(
                queries[i][s], k_all, v_all, s.start, 1.0, window, softcap, sinks
            )
            np.testing.assert_allclose(got[row : row + s.stop - s.start], want, **TOL)
            row += s.stop - s.start
        for chunk in chunks:
            chunk.cache.length = chunk.start + chunk.length

    step([(0, n - 1) for n in lengths[:-1]] + [(0, lengths[-1] - 3)])
    # the last token of the others as decode rows (two padded groups), the longest prefills 3
    step([(n - 1, n) for n in lengths[:-1]] + [(lengths[-1] - 3, lengths[-1])])


@pytest.mark.parametrize("window", [None, 6])
def test_decode_rows_sharing_a_cached_prefix_attend_it_together(window, attention_path):
    """Sequences that hold the same cached prefix blocks: on numpy's path they meet those
    keys in one matmul (a SharedRun); on either path the result must equal naive attention
    over each sequence's keys."""
    n_kv, n_heads, head_dim, block = 2, 6, 8, 4
    pool = BlockPool(1, n_kv, head_dim, n_blocks=64, block_size=block)
    rng = np.random.default_rng(11)
    prefix = 12  # three full blocks, written by the first sequence
    lengths = [20, 15, 13, 22]  # tokens each sequence holds before its decode row
    keys = [rng.standard_normal((n + 1, n_kv, head_dim)).astype(np.float32) for n in lengths]
    values = [rng.standard_normal((n + 1, n_kv, head_dim)).astype(np.float32) for n in lengths]
    queries = [rng.standard_normal((n + 1, n_heads, head_dim)).astype(np.float32) for n in lengths]
    for i in range(1, len(lengths)):  # the same prefix: the same keys and values
        keys[i][:prefix], values[i][:prefix] = keys[0][:prefix], values[0][:prefix]

    def store(cache, i, start, end):
        cache.reserve(end)
        chunk = SequenceChunk(cache, start, end - start)
        rows = slice(start, end)
        attend_layout(0, queries[i][rows], keys[i][rows], values[i][rows], BatchLayout([chunk]))
        cache.length = end

    owner = PagedKVCache(pool)
    store(owner, 0, 0, lengths[0])
    caches = [owner]
    for i in range(1, len(lengths)):
        cache = PagedKVCache(pool, shared_prefix=owner.shared_blocks()[: prefix // block])
        store(cache, i, prefix, lengths[i])
        caches.append(cache)
    for cache in caches:
        cache.reserve(cache.length + 1)
    layout = BatchLayout([SequenceChunk(c, n, 1) for c, n in zip(caches, lengths, strict=True)])
    got = attend_layout(
        0,
        np.concatenate([q[n : n + 1] for q, n in zip(queries, lengths, strict=True)]),
        np.concatenate([k[n : n + 1] for k, n in zip(keys, lengths, strict=True)]),
        np.concatenate([v[n : n + 1] for v, n in zip(values, lengths, strict=True)]),
        layout,
        window,
    )
    if attention_path == "numpy" and window is None:  # within a window the prefix is out of sight
        groups = layout.plans[("decode", 0, window, n_kv)]  # the layer's own KV heads
        assert sum(len(run.members) for g in groups for run in g.shared) == len(lengths)
    for row, n in enumerate(lengths):
        want = _naive_attention(
            queries[row][n : n + 1],
            keys[row].transpose(1, 0, 2),
            values[row].transpose(1, 0, 2),
            n,
            1.0,
            window,
        )
        np.testing.assert_allclose(got[row : row + 1], want, **TOL)


def test_decode_rows_are_grouped_so_padding_stays_bounded():
    from runtime.models.attention import group_by_length

    lengths = [100, 10, 60, 45, 9, 200]
    assert group_by_length(lengths) == [[5, 0], [2, 3], [1, 4]]
    for group in group_by_length(lengths):
        assert max(lengths[i] for i in group) <= 2 * min(lengths[i] for i in group)
    assert group_by_length(lengths, factor=1000) == [[5, 0, 2, 3, 1, 4]]
