"""Admission: a FIFO queue in front of a bounded set of KV slots."""
from __future__ import annotations

from collections import deque

from ..models.kv_cache import KVCache
from .sequence import Sequence


class Scheduler:
    def __init__(self, kv: KVCache):
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Give free slots to waiting requests, oldest first; a full engine queues, never fails.
        A fork (one of n samples) waits until its sibling's prompt is prefilled, without holding
        up the requests behind it."""
        admitted, held = [], deque()
        while self.waiting:
            seq = self.waiting.popleft()
            if not self.kv.num_free or self._waits_for_sibling(seq, held):
                held.append(seq)
                continue
            seq.cache = self.kv.view(self.kv.allocate())
            admitted.append(seq)
            self.running.append(seq)
        self.waiting = held
        return admitted

    def _waits_for_sibling(self, seq: Sequence, held: deque[Sequence]) -> bool:
        sibling = seq.fork_of
        if sibling is None:
            return False
        if sibling.prompt_len < 2 or not any(sibling in q for q in (self.running, self.waiting, held)):
            seq.fork_of = None  # nothing to copy, or the sibling is gone: prefill in full
            return False
        return sibling.prefilled < sibling.prompt_len - 1

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.kv.release(seq.slot)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
