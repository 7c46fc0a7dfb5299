"""Prefix cache: full KV blocks of earlier prompts, found again by their token ids.

Block i of a prompt is keyed by a hash chain: key_i = H(key_{i-1}, tokens of block i), the
chain starting from a namespace (model and LoRA set), so a key names the whole prefix up
to and including its block. A new sequence takes the longest run of cached blocks that
matches its prompt and skips their prefill. The cache holds one reference on each block it
keeps; blocks that only the cache holds are evicted least recently used first, when the
pool needs room or the cache exceeds its block budget. Shared blocks in use are never
evicted (their reference count is above one).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.kv_pool import BlockPool


@dataclass
class PrefixCacheStats:
    queries: int = 0
    hits: int = 0  # lookups that found at least one block
    prompt_tokens: int = 0  # tokens of every prompt looked up
    cached_tokens: int = 0  # of those, tokens whose KV came from the cache

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Entry:
    block: int
    tokens: tuple[int, ...]  # kept to rule out hash collisions


class PrefixCache:
    """Maps hash-chain keys of full blocks to pool blocks; LRU over what only it holds."""

    def __init__(self, pool: BlockPool, namespace: str, max_blocks: int | None = None) -> None:
        self.pool = pool
        self.namespace = namespace
        self.max_blocks = max_blocks if max_blocks is not None else pool.n_blocks
        self.stats = PrefixCacheStats()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._entries)

    def block_keys(self, token_ids: Sequence[int], namespace: str | None = None) -> list[bytes]:
        """The chain key of every full block of `token_ids`."""
        bs = self.pool.block_size
        key = hashlib.blake2b((namespace or self.namespace).encode(), digest_size=16).digest()
        keys = []
        for start in range(0, len(token_ids) - bs + 1, bs):
            block = ",".join(map(str, token_ids[start : start + bs])).encode()
            key = hashlib.blake2b(key + block, digest_size=16).digest()
            keys.append(key)
        return keys

    def lookup(self, prompt_ids: Sequence[int]) -> list[int]:
        """Cached blocks for the longest prefix of the prompt, leaving at least one token
        to compute (the last prompt position must run to produce logits)."""
        self.stats.queries += 1
        self.stats.prompt_tokens += len(prompt_ids)
        bs = self.pool.block_size
        usable = (len(prompt_ids) - 1) // bs
        blocks = []
        for i, key in enumerate(self.block_keys(prompt_ids[: usable * bs])):
            entry = self._entries.get(key)
            if entry is None or entry.tokens != tuple(prompt_ids[i * bs : (i + 1) * bs]):
                break
            self._entries.move_to_end(key)
            blocks.append(entry.block)
        if blocks:
            self.stats.hits += 1
            self.stats.cached_tokens += len(blocks) * bs
        return blocks

    def insert(self, token_ids: Sequence[int], blocks: Sequence[int]) -> None:
        """Remember the full blocks of a sequence whose KV for `token_ids` is written."""
        bs = self.pool.block_size
        for i, key in enumerate(self.block_keys(token_ids)):
            if i >= len(blocks):
                break
            if key in self._entries:
                self._entries.move_to_end(key)
                continue
            self.pool.retain([blocks[i]])
            self._entries[key] = _Entry(blocks[i], tuple(token_ids[i * bs : (i + 1) * bs]))
        self._shrink(self.max_blocks)

    def evict(self, n_blocks: int) -> int:
        """Free up to `n_blocks` blocks that only the cache holds, oldest first."""
        freed = 0
        for key in list(self._entries):
            if freed >= n_blocks:
                break
            entry = self._entries[key]
            if self.pool.refcount[entry.block] == 1:  # nobody but us: safe to drop
                del self._entries[key]
                self.pool.release([entry.block])
                freed += 1
        return freed

    def clear(self) -> None:
        self.evict(len(self._entries))

    def _shrink(self, limit: int) -> None:
        if len(self._entries) > limit:
            self.evict(len(self._entries) - limit)

    @property
    def nbytes(self) -> int:
        return len(self._entries) * self.pool.block_nbytes
