"""Prefix cache: the K/V blocks of prompt prefixes, shared with later requests that start the same way.

Prompts are cut into the pool's blocks; block i is keyed by a hash chain over blocks 0..i (its parent's
key and its own tokens), so a key names a whole prefix, as in vLLM. The cache holds a reference on each
block it keeps; on admission the longest run of cached blocks is mapped into the request's block table
(no copy) and only the rest of the prompt is prefilled.

Why a hit gives bitwise the tokens of a cold run: only K/V written by the prompt path are kept, and
prompts always go through the invariant kernels, where a position's K/V depends only on the tokens up
to it (not on the chunking, the batch or the block). Decode-written positions (fast path, maybe
drifted) never lie in a kept block: only whole prompt blocks are kept, and a write into a shared block
copies it first. At least one prompt position is always prefilled: its logits choose the first token.

A preempted request leaves its computed blocks here too (scheduler.py): its prompt's, and its output's where
its policy's decode rows write the prompt path's bits; its readmission maps them back.

Bounded by `max_tokens` cached positions; the least recently used block goes first, and when the pool
runs out the least recently used block that no request holds is freed (`KVPool.reclaim`). A hit
touches the chain from its last block back to its first, so a parent is always younger than its
children and eviction takes leaves before the prefixes they hang from.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from ..models.kv_cache import BlockTable, KVPool
from ..options.engine import PREFIX_CACHE_TOKENS


@dataclass
class _Block:
    tokens: tuple[int, ...]   # checked on every hit: a hash collision can never reuse wrong K/V
    block: int                # the pool's block, one reference held by the cache


@dataclass
class PrefixStats:
    hits: int = 0             # admissions that reused at least one block
    misses: int = 0           # admissions that reused none
    reused_tokens: int = 0    # prompt positions shared instead of computed
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, pool: KVPool, max_tokens: int = PREFIX_CACHE_TOKENS):
        self.pool, self.block = pool, pool.block_size
        if max_tokens < self.block:
            raise ValueError(f"prefix cache: need max_tokens >= the block size {self.block}, got {max_tokens}")
        self.max_blocks = max_tokens // self.block
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self.stats = PrefixStats()
        pool.reclaim = self._reclaim

    @property
    def cached_tokens(self) -> int:
        return len(self._blocks) * self.block

    @property
    def evictable(self) -> int:
        """Cached blocks no request holds: freed when the pool needs them."""
        return sum(self.pool.refs[b.block] == 1 for b in self._blocks.values())

    def _chain(self, prompt: list[int], limit: int) -> list[tuple[bytes, tuple[int, ...]]]:
        """(key, tokens) of each whole block within the first `limit` positions."""
        out, parent = [], b""
        for start in range(0, limit - self.block + 1, self.block):
            tokens = tuple(prompt[start:start + self.block])
            parent = hashlib.blake2b(parent + repr(tokens).encode(), digest_size=16).digest()
            out.append((parent, tokens))
        return out

    def _touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):
            self._blocks.move_to_end(key)

    def _cached_run(self, prompt: list[int]) -> list[tuple[bytes, _Block]]:
        """The longest run of `prompt`'s whole blocks the cache holds, leaving its last position to compute."""
        run = []
        for key, tokens in self._chain(prompt, len(prompt) - 1):
            cached = self._blocks.get(key)
            if cached is None or cached.tokens != tokens:
                break
            run.append((key, cached))
        return run

    def held_by_requests(self, prompt: list[int]) -> int:
        """How many blocks `load` would map for `prompt` that a request holds too (not free, not evictable:
        admitting `prompt` takes none of the pool for them)."""
        return sum(self.pool.refs[cached.block] > 1 for _, cached in self._cached_run(prompt))

    def load(self, prompt: list[int], table: BlockTable) -> int:
        """Map the longest cached prefix of `prompt` (leaving its last position to compute) into the empty
        `table`; returns how many positions it holds."""
        run = self._cached_run(prompt)
        for _, cached in run:
            table.append_shared(cached.block)
        self._touch([key for key, _ in run])
        n = len(run) * self.block
        self.stats.hits += bool(n)
        self.stats.misses += not n
        self.stats.reused_tokens += n
        return n

    def store(self, prompt: list[int], table: BlockTable) -> None:
        """Keep the whole blocks of `prompt`, whose K/V the prompt path has just written into `table`."""
        chain = self._chain(prompt, len(prompt))
        for i, (key, tokens) in enumerate(chain):
            if key not in self._blocks:
                self.pool.retain(table.blocks[i])
                self._blocks[key] = _Block(tokens, table.blocks[i])
        self._touch([key for key, _ in chain])
        while len(self._blocks) > self.max_blocks:
            self._evict(next(iter(self._blocks)))

    def _evict(self, key: bytes) -> None:
        self.pool.release(self._blocks.pop(key).block)
        self.stats.evicted_blocks += 1

    def _reclaim(self) -> bool:
        """Free the least recently used block that only the cache holds; False if there is none."""
        key = next((k for k, b in self._blocks.items() if self.pool.refs[b.block] == 1), None)
        if key is None:
            return False
        self._evict(key)
        return True

    def clear(self) -> int:
        """Forget every cached prefix (new weights make their K/V stale); the blocks dropped. A block a running
        request still holds stays its own until it finishes."""
        n = len(self._blocks)
        while self._blocks:
            self._evict(next(iter(self._blocks)))
        return n
