"""Prefix cache: the K/V of prompt prefixes, reused by later requests that start the same way.

Prompts are cut into blocks of `block` tokens; block i is keyed by a hash chain over blocks
0..i (its parent's key and its own tokens), so a key names a whole prefix, as in vLLM. On
admission the longest run of cached blocks is copied into the request's slot and only the
rest of the prompt is prefilled.

Why a hit gives bitwise the tokens of a cold run: only K/V written by the prompt path are
stored, and prompts always go through the invariant kernels, where a position's K/V depends
only on the tokens up to it (not on the chunking, the batch or the slot). Decode-written
columns (fast path, maybe drifted) are never stored. At least one prompt position is always
prefilled: its logits choose the first token.

Bounded by `max_tokens` cached positions; the least recently used block goes first. A hit
touches the chain from its last block back to its first, so a parent is always younger than
its children and eviction takes leaves before the prefixes they hang from.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..models.kv_cache import KVCache
from ..options.engine import PREFIX_CACHE_TOKENS

DEFAULT_BLOCK = 16


@dataclass
class _Block:
    tokens: tuple[int, ...]   # checked on every hit: a hash collision can never reuse wrong K/V
    k: torch.Tensor           # [layers, kv_heads, block, head_dim]
    v: torch.Tensor


@dataclass
class PrefixStats:
    hits: int = 0             # admissions that reused at least one block
    misses: int = 0           # admissions that reused none
    reused_tokens: int = 0    # prompt positions copied instead of computed
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, max_tokens: int = PREFIX_CACHE_TOKENS, block: int = DEFAULT_BLOCK):
        if block < 1 or max_tokens < block:
            raise ValueError(f"prefix cache: need block >= 1 and max_tokens >= block, got {block}, {max_tokens}")
        self.block, self.max_blocks = block, max_tokens // block
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self.stats = PrefixStats()

    @property
    def cached_tokens(self) -> int:
        return len(self._blocks) * self.block

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

    def load(self, prompt: list[int], kv: KVCache, slot: int) -> int:
        """Copy the longest cached prefix of `prompt` (leaving its last position to compute) into
        `slot`; returns how many positions it holds."""
        hit = []
        for key, tokens in self._chain(prompt, len(prompt) - 1):
            block = self._blocks.get(key)
            if block is None or block.tokens != tokens:
                break
            kv.write_span(slot, len(hit) * self.block, block.k, block.v)
            hit.append(key)
        self._touch(hit)
        n = len(hit) * self.block
        self.stats.hits += bool(n)
        self.stats.misses += not n
        self.stats.reused_tokens += n
        return n

    def store(self, prompt: list[int], kv: KVCache, slot: int) -> None:
        """Keep the whole blocks of `prompt`, whose K/V the prompt path has just written into `slot`."""
        chain = self._chain(prompt, len(prompt))
        for i, (key, tokens) in enumerate(chain):
            if key not in self._blocks:
                k, v = kv.read_span(slot, i * self.block, (i + 1) * self.block)
                self._blocks[key] = _Block(tokens, k, v)
        self._touch([key for key, _ in chain])
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
            self.stats.evicted_blocks += 1
