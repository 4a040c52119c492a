"""Admission: a FIFO queue in front of a bounded set of KV slots."""
from __future__ import annotations

from collections import deque

from ..kv_cache import KVCache
from .sequence import Sequence


class Scheduler:
    def __init__(self, kv: KVCache):
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Give free slots to waiting requests, oldest first; a full engine queues, never fails."""
        admitted = []
        while self.waiting and self.kv.num_free:
            seq = self.waiting.popleft()
            seq.cache = self.kv.view(self.kv.allocate())
            admitted.append(seq)
        self.running += admitted
        return admitted

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            self.kv.release(seq.slot)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
