"""Prefix cache: full KV blocks of earlier prompts, found again by their token ids.

Block i of a prompt is keyed by a hash chain: key_i = H(key_{i-1}, tokens of block i), the
chain starting from a namespace (model and LoRA set), so a key names the whole prefix up
to and including its block. A new sequence takes the longest run of cached blocks that
matches its prompt and skips their prefill. The cache holds one reference on each block it
keeps; blocks that only the cache holds are evicted least recently used first, when the
pool needs room or the cache exceeds its block budget. Shared blocks in use are never
evicted (their reference count is above one).

With sliding-window layers (runtime/kv_pool.py), an entry keeps one block per layer group,
and a windowed group's block may be missing (its sequence had moved past it). A cached
prefix is usable only where every windowed group still has the blocks the next query can
see, so a lookup takes the longest prefix that ends on such a complete window.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from runtime.kv_pool import BlockPool, SharedBlock


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
    blocks: SharedBlock  # one per layer group
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

    def lookup(self, prompt_ids: Sequence[int], namespace: str | None = None) -> list[SharedBlock]:
        """Cached blocks for the longest usable prefix of the prompt, leaving at least one
        token to compute (the last prompt position must run to produce logits). `namespace`
        (default: the cache's) is the one the blocks were inserted under."""
        self.stats.queries += 1
        self.stats.prompt_tokens += len(prompt_ids)
        bs = self.pool.block_size
        usable = (len(prompt_ids) - 1) // bs
        entries = []
        for i, key in enumerate(self.block_keys(prompt_ids[: usable * bs], namespace)):
            entry = self._entries.get(key)
            if entry is None or entry.tokens != tuple(prompt_ids[i * bs : (i + 1) * bs]):
                break
            entries.append((key, entry))
        found = [entry.blocks for _, entry in entries]
        n = len(found)
        while n > 0 and not self._window_complete(found, n):
            n -= 1
        for key, _ in entries[:n]:
            self._entries.move_to_end(key)
        if n:
            self.stats.hits += 1
            self.stats.cached_tokens += n * bs
        return [entry.blocks for _, entry in entries[:n]]

    def insert(
        self,
        token_ids: Sequence[int],
        blocks: Sequence[SharedBlock],
        namespace: str | None = None,
    ) -> None:
        """Remember the full blocks of a sequence whose KV for `token_ids` is written, under
        `namespace` (default: the cache's; e.g. the model's plus the sequence's LoRA set)."""
        bs = self.pool.block_size
        for i, key in enumerate(self.block_keys(token_ids, namespace)):
            if i >= len(blocks):
                break
            entry = self._entries.get(key)
            if entry is not None and None not in entry.blocks:
                self._entries.move_to_end(key)
                continue
            if entry is not None:  # fill in window blocks it lacked, drop the old entry
                self._drop(key)
            for group, block in enumerate(blocks[i]):
                if block is not None:
                    self.pool.retain([block], group)
            self._entries[key] = _Entry(tuple(blocks[i]), tuple(token_ids[i * bs : (i + 1) * bs]))
        self._shrink(self.max_blocks)

    def evict(self, n_blocks: int) -> int:
        """Free up to `n_blocks` entries that only the cache holds, oldest first."""
        freed = 0
        for key in list(self._entries):
            if freed >= n_blocks:
                break
            if self._only_ours(self._entries[key]):  # nobody but us: safe to drop
                self._drop(key)
                freed += 1
        return freed

    def _only_ours(self, entry: _Entry) -> bool:
        return all(
            block is None or self.pool.groups[g].refcount[block] == 1
            for g, block in enumerate(entry.blocks)
        )

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        for group, block in enumerate(entry.blocks):
            if block is not None:
                self.pool.release([block], group)

    def _window_complete(self, found: list[SharedBlock], n: int) -> bool:
        """Whether every windowed group has the blocks that a query right after the first
        `n` blocks of `found` can see."""
        bs, end = self.pool.block_size, n * self.pool.block_size
        for group, layer_group in enumerate(self.pool.groups):
            if layer_group.window is None:
                continue
            first = max(0, end + 1 - layer_group.window) // bs
            if any(found[i][group] is None for i in range(first, n)):
                return False
        return True

    def clear(self) -> None:
        self.evict(len(self._entries))

    def _shrink(self, limit: int) -> None:
        if len(self._entries) > limit:
            self.evict(len(self._entries) - limit)

    @property
    def nbytes(self) -> int:
        return sum(
            self.pool.group_nbytes(g)
            for entry in self._entries.values()
            for g, block in enumerate(entry.blocks)
            if block is not None
        )
