"""Admission by blocks: a FIFO queue in front of the KV pool, and preemption when the pool runs out.

A request is admitted, oldest first, while fewer than `max_num_seqs` run and the pool has the blocks of
its prompt plus one for each running request (the next block any of them may need). A step that still
runs out preempts the newest running request: its blocks are freed and it waits at the front of the
queue, then recomputes its K/V through the prompt path (the invariant kernels: the same bits, so the same
tokens for every deterministic policy). A full engine queues; it never fails a step.
"""
from __future__ import annotations

from collections import deque

from ..models.kv_cache import BlockTable, KVPool, PoolExhausted, blocks_for
from .prefix_cache import PrefixCache
from .sequence import Sequence


class Scheduler:
    def __init__(self, pool: KVPool, max_num_seqs: int, prefix: PrefixCache | None = None):
        self.pool, self.max_num_seqs, self.prefix = pool, max_num_seqs, prefix
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def free_blocks(self) -> int:
        """Blocks a request could get now: free ones, and cached ones nobody else holds."""
        return self.pool.num_free + (self.prefix.evictable if self.prefix is not None else 0)

    def admit(self) -> list[Sequence]:
        """Give blocks to waiting requests, oldest first (one that does not fit holds up those behind it).
        A fork (one of n samples) waits until its sibling's prompt is prefilled, without holding up the
        requests behind it."""
        admitted, held = [], deque()
        while self.waiting:
            seq = self.waiting.popleft()
            if self._waits_for_sibling(seq, held):
                held.append(seq)
                continue
            if len(self.running) >= self.max_num_seqs or not self._fits(seq):
                held.append(seq)
                held.extend(self.waiting)
                self.waiting.clear()
                break
            seq.cache = BlockTable.empty(self.pool)
            admitted.append(seq)
            self.running.append(seq)
        self.waiting = held
        return admitted

    def _fits(self, seq: Sequence) -> bool:
        return blocks_for(seq.prefill_end + 1, self.pool.block_size) + len(self.running) <= self.free_blocks

    def _waits_for_sibling(self, seq: Sequence, held: deque[Sequence]) -> bool:
        sibling = seq.fork_of
        if sibling is None:
            return False
        if sibling.prompt_len < 2 or not any(sibling in q for q in (self.running, self.waiting, held)):
            seq.fork_of = None  # nothing to share, or the sibling is gone: prefill in full
            return False
        return sibling.cache is None or sibling.prefilled < sibling.prompt_len - 1

    def plan(self, max_rows: int, chunk: int | None) -> tuple[list[tuple[Sequence, int, int]], list[Sequence]]:
        """This step's prompt chunks (seq, start, end), oldest first, within the rows the decoding requests leave
        of `max_rows` (and at most `chunk` per request); and the decoding requests."""
        batch = [s for s in self.running if not s.prefilling and s.finish_reason is None]
        budget, chunk = max_rows - len(batch), chunk or 1 << 62
        prefills = []
        for s in self.running:
            rows = min(s.prefill_end - s.prefilled, chunk, budget) if s.prefilling else 0
            if rows > 0:
                prefills.append((s, s.prefilled, s.prefilled + rows))
                budget -= rows
        return prefills, batch

    def reserve_step(self, prefills: list, batch: list[Sequence]) -> tuple[list, list[Sequence]]:
        """Blocks for every position this step writes (a decode row's proposals included), oldest request
        first; a request preempted to make room sits the step out."""
        writes = {id(s): (s, a, b) for s, a, b in prefills}
        writes.update({id(s): (s, s.last_fed_pos, s.next_pos + len(s.drafts)) for s in batch})
        self.reserve([writes[id(s)] for s in self.running if id(s) in writes])
        return [p for p in prefills if p[0].cache is not None], [s for s in batch if s.cache is not None]

    def reserve(self, writes: list[tuple[Sequence, int, int]]) -> None:
        """Blocks for this step's writes (seq, start, end), in the order given (oldest first); when the pool
        runs out, the newest running request is preempted, until the write fits or its own request was."""
        for seq, start, end in writes:
            while seq.cache is not None:
                try:
                    seq.cache.prepare(start, end)
                    break
                except PoolExhausted:
                    self.preempt(self.running[-1])

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.cache.free()
        seq.preempted()
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            seq.cache.free()
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
