"""The CPU's attention on the tensor path (runtime/models/tensor_attention.py), alone: a
row's numbers do not depend on the rows beside it, nor on whether its position is
prefilled or decoded, nor on torch's thread count (runtime/kernels/core_share.py changes it
while other processes hold cores). Bitwise, on every CPU: BLAS rounds a row of a product by
the product's row count and its operands' layout (on an AMD EPYC Zen 4 a decode row alone
came out up to 7e-7 from the same row beside a mate, and a prefilled row from the decoded
one), so the attention hands BLAS items of one shape and layout whatever the batch. Each
case also holds the result to float64 attention, so an answer equal everywhere is also
the right one.
"""

from __future__ import annotations

import pytest
import torch

from runtime.models.tensor_attention import decode_attention, prompt_attention

# (query heads, KV heads, head size): the tiny llama, the tiny gemma3, SmolLM2-135M,
# Gemma 3 270M (one KV head, 256 wide), and heads that share nothing (G = 1)
SHAPES = [(4, 2, 16), (4, 2, 32), (9, 3, 64), (4, 1, 256), (4, 4, 64)]
POOL_SLOTS = 2048


def _pool(rng: torch.Generator, n_kv: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's keys and values as the pool keeps them, `[slots, Hkv, Dh]`."""
    keys = torch.randn(POOL_SLOTS, n_kv, head_dim, generator=rng)
    return keys, torch.randn(POOL_SLOTS, n_kv, head_dim, generator=rng)


def _decode(q, keys, values, index, visible, softcap=None, sinks=None) -> torch.Tensor:
    """Rows `q [M, H, Dh]` over their gathered windows `index [M, L]`, as the static step
    (attend_static) and the eager step (attend_layout) gather them -> `[M, H, Dh]`."""
    kd, vd = keys[index].transpose(1, 2), values[index].transpose(1, 2)  # [M, Hkv, L, Dh]
    out = decode_attention(q.unsqueeze(2), kd, vd, visible[:, None, None, :], softcap, sinks)
    return out[:, :, 0]


def _assert_rows_decode_alone(got, q, keys, values, index, visible, softcap, sinks, start=0):
    """Each row of `got` (rows of one call, the first at position `start`) is, bit for bit,
    that row's query decoded alone over its keys."""
    for i in range(len(q)):
        one = slice(i, i + 1)
        alone = _decode(q[one], keys, values, index[one], visible[one], softcap, sinks)
        assert torch.equal(alone[0], got[i]), f"row {i} (position {start + i}) alone"


def _at_one_thread(run):
    """`run()` with torch at one thread, its thread count restored after."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return run()
    finally:
        torch.set_num_threads(threads)


def _reference(q, keys, values, index, visible, softcap=None, sinks=None) -> torch.Tensor:
    """float64 softmax attention, each query head over its KV head -> `[M, H, Dh]`; `sinks`
    `[H]`: one more logit in each head's softmax, weighing no value (gpt-oss)."""
    group = q.shape[1] // keys.shape[1]
    kd = keys[index].double().repeat_interleave(group, dim=2)  # [M, L, H, Dh]
    vd = values[index].double().repeat_interleave(group, dim=2)
    scores = torch.einsum("mhd,mlhd->mhl", q.double(), kd)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible[:, None, :], -torch.inf)
    if sinks is not None:
        sink = sinks.double()[None, :, None].expand(*scores.shape[:2], 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return torch.einsum("mhl,mlhd->mhd", weights, vd)
    return torch.einsum("mhl,mlhd->mhd", torch.softmax(scores, dim=-1), vd)


DECODE_CASES = [
    *[(shape, width, None, False) for shape in SHAPES for width in (48, 256, 512)],
    ((4, 2, 16), 256, 50.0, False),  # Gemma 2's capped scores
    ((9, 3, 64), 512, 50.0, False),
    ((4, 2, 16), 48, None, True),  # gpt-oss's sinks
    ((4, 2, 16), 512, None, True),
]


@pytest.mark.parametrize(
    "shape, width, softcap, with_sinks",
    DECODE_CASES,
    ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else str(c),
)
def test_a_decode_rows_attention_does_not_depend_on_its_batch(shape, width, softcap, with_sinks):
    """Nine rows of random visible lengths in one call; each row alone, and in the first
    two, gives the same bits (48 positions: a sliding window's width, padded to a chunk),
    at one thread as at the process's own."""
    n_heads, n_kv, head_dim = shape
    rng = torch.Generator().manual_seed(sum(shape) + width)
    keys, values = _pool(rng, n_kv, head_dim)
    rows = 9
    q = torch.randn(rows, n_heads, head_dim, generator=rng) / head_dim**0.5
    index = torch.randint(0, POOL_SLOTS, (rows, width), generator=rng)
    seen = torch.randint(1, width + 1, (rows, 1), generator=rng)
    visible = torch.arange(width)[None, :] < seen  # [M, L]
    sinks = 3 * torch.randn(n_heads, generator=rng) if with_sinks else None

    batched = _decode(q, keys, values, index, visible, softcap, sinks)
    want = _reference(q, keys, values, index, visible, softcap, sinks)
    torch.testing.assert_close(batched.double(), want, rtol=0, atol=1e-5)
    _assert_rows_decode_alone(batched, q, keys, values, index, visible, softcap, sinks)
    pair = _decode(q[:2], keys, values, index[:2], visible[:2], softcap, sinks)
    assert torch.equal(pair, batched[:2])
    again = _at_one_thread(lambda: _decode(q, keys, values, index, visible, softcap, sinks))
    assert torch.equal(again, batched)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(
    "start, rows, with_sinks", [(0, 40, False), (290, 30, False), (500, 3, False), (0, 40, True)]
)
def test_a_prompts_rows_attend_as_decode_rows(shape, start, rows, with_sinks):
    """A prompt chunk's rows (prefilled from `start`, as attend_layout gives the CPU's
    prompt rows their decode width) each give the bits of that row decoded alone at its
    position, in one and two threads: so a resumed request, or one whose prompt partly hit
    the prefix cache, gets the numbers it got decoding."""
    n_heads, n_kv, head_dim = shape
    rng = torch.Generator().manual_seed(sum(shape) + start + rows)
    keys, values = _pool(rng, n_kv, head_dim)
    end = start + rows
    width = 256 if end <= 256 else 512  # static_decode's width for the chunk's last row
    index = torch.randperm(POOL_SLOTS, generator=rng)[:width]  # the sequence's slots
    q = torch.randn(rows, n_heads, head_dim, generator=rng) / head_dim**0.5
    positions = torch.arange(start, end)[:, None]
    visible = torch.arange(width)[None, :] <= positions  # [n, L]: causal
    sinks = 3 * torch.randn(n_heads, generator=rng) if with_sinks else None

    prompt = prompt_attention(q, keys[index], values[index], visible, None, sinks)
    every = index[None, :].expand(rows, width)
    want = _reference(q, keys, values, every, visible, None, sinks)
    torch.testing.assert_close(prompt.double(), want, rtol=0, atol=1e-5)
    _assert_rows_decode_alone(prompt, q, keys, values, every, visible, None, sinks, start)
    again = _at_one_thread(
        lambda: prompt_attention(q, keys[index], values[index], visible, None, sinks)
    )
    assert torch.equal(again, prompt)


@pytest.mark.parametrize("softcap, with_sinks", [(50.0, False), (None, True), (5.0, True)])
def test_the_gpus_written_out_attention_equals_the_reference(softcap, with_sinks):
    """What a GPU runs where the fused kernel takes no cap or sinks (`_gpu_attention`), here
    on the CPU's tensors: decode rows over their own keys with a boolean mask, and a prompt's
    rows over one sequence's keys with a causal one."""
    from runtime.models.tensor_attention import _gpu_attention

    n_heads, n_kv, head_dim, rows, width = 6, 2, 16, 3, 48
    rng = torch.Generator().manual_seed(5)
    keys, values = _pool(rng, n_kv, head_dim)
    q = torch.randn(rows, n_heads, head_dim, generator=rng) / head_dim**0.5
    index = torch.randint(0, POOL_SLOTS, (rows, width), generator=rng)
    visible = torch.arange(width)[None, :] < torch.tensor([[5], [48], [17]])
    sinks = 3 * torch.randn(n_heads, generator=rng) if with_sinks else None
    kd, vd = keys[index].transpose(1, 2), values[index].transpose(1, 2)
    got = _gpu_attention(q.unsqueeze(2), kd, vd, visible[:, None, None, :], softcap, sinks)
    want = _reference(q, keys, values, index, visible, softcap, sinks)
    torch.testing.assert_close(got[:, :, 0].double(), want, rtol=0, atol=1e-5)
    # a prompt of `width` rows: [1, H, n, Dh] over [1, Hkv, L, Dh], visible [n, L]
    q = torch.randn(width, n_heads, head_dim, generator=rng) / head_dim**0.5
    causal = torch.arange(width)[None, :] <= torch.arange(width)[:, None]
    kp, vp = (x[index[0]].transpose(0, 1).unsqueeze(0) for x in (keys, values))
    got = _gpu_attention(q.transpose(0, 1).unsqueeze(0), kp, vp, causal, softcap, sinks)
    every = index[:1].expand(width, width)
    want = _reference(q, keys, values, every, causal, softcap, sinks)
    torch.testing.assert_close(got[0].transpose(0, 1).double(), want, rtol=0, atol=1e-5)
