"""Admission by blocks: a FIFO queue in front of the KV pool, and preemption that does not thrash.

Under memory pressure a scheduler that admits whatever fits now thrashes: a preempted request whose
prompt fits again is readmitted at once, recomputes its prompt, and is preempted again at the next
decode step (1,224 preemptions for 64 requests in the run that showed it). What keeps it graceful, as
in vLLM and SGLang:

- Admission keeps a reserve: a request is admitted, oldest first, only while the pool keeps free the
  blocks its prompt needs, the growth of every running request (and its own) and a watermark. A
  request's growth is `growth_ratio` of the tokens it may still write (SGLang's "new token ratio"): 1.0
  at first, so that requests running to their limit are never preempted; it decays step by step while
  nothing is preempted, because most requests stop early, and goes back to 1.0 at a preemption.
- A step that preempted is followed by one that admits nobody: the blocks the victim gave back go to
  the running requests' growth, not to a newcomer (vLLM admits nobody in a schedule that preempted;
  admission here runs at the start of a step, before its blocks are reserved, hence the next step).
- The victim is the running request with the least progress (fewest output tokens), the newest among
  equals: the least work is recomputed, and the oldest requests finish and give their blocks back.
  It waits at the front of the queue and comes back under the full reserve (the ratio is back at 1.0):
  the hysteresis that stops it from being readmitted into the same shortage.
- With a prefix cache, a victim's computed K/V stay behind as cached blocks (`_keep_computed`): its
  readmission maps those the cache still holds and recomputes only the rest.

A preempted request recomputes its K/V through the prompt path (the invariant kernels: the same bits, so
the same tokens and logprobs under every deterministic policy). A full engine queues; it never fails a step.
"""
from __future__ import annotations

import math
from collections import deque

from ..models.kv_cache import BlockTable, KVPool, PoolExhausted, blocks_for
from .prefix_cache import PrefixCache
from .sequence import Sequence

WATERMARK = 0.01          # of the pool's blocks kept free beyond every reserve (vLLM's default)
RATIO_MIN = 0.1           # the growth ratio never reserves less than this share of the tokens to come
RATIO_DECAY = 0.002       # per step without preemption: from 1.0 to RATIO_MIN in 450 steps


class Scheduler:
    def __init__(self, pool: KVPool, max_num_seqs: int, prefix: PrefixCache | None = None,
                 max_len: int | None = None):
        self.pool, self.max_num_seqs, self.prefix = pool, max_num_seqs, prefix
        self.max_len = max_len or pool.num_blocks * pool.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.growth_ratio = 1.0
        self.watermark = max(1, math.ceil(WATERMARK * pool.num_blocks))
        self._preempted = False      # the last reserve preempted: the next admission admits nobody

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def free_blocks(self) -> int:
        """Blocks a request could get now: free ones, and cached ones nobody else holds."""
        return self.pool.num_free + (self.prefix.evictable if self.prefix is not None else 0)

    # --- admission ------------------------------------------------------------------
    def admit(self) -> list[Sequence]:
        """Give blocks to waiting requests, oldest first, while the reserve holds (one that does not fit holds
        up those behind it). A fork (one of n samples) waits until its sibling's prompt is prefilled, without
        holding up the requests behind it. Nobody is admitted right after a preemption."""
        if self._preempted:
            self._preempted = False
            return []
        self.growth_ratio = max(RATIO_MIN, self.growth_ratio - RATIO_DECAY)
        room = self.free_blocks - self.watermark - sum(self._growth(s) for s in self.running)
        admitted, held = [], deque()
        while self.waiting:
            seq = self.waiting.popleft()
            if self._waits_for_sibling(seq, held):
                held.append(seq)
                continue
            need = self._need(seq)
            if len(self.running) >= self.max_num_seqs or not self._fits(seq, need, room):
                held.append(seq)
                held.extend(self.waiting)
                self.waiting.clear()
                break
            room -= need
            seq.cache = BlockTable.empty(self.pool)
            admitted.append(seq)
            self.running.append(seq)
        self.waiting = held
        return admitted

    def _fits(self, seq: Sequence, need: int, room: int) -> bool:
        """Within the reserve; or, on an idle engine, the prompt alone fits (a reserve the pool can never keep
        must not hold a lone request back for good)."""
        if need <= room:
            return True
        return not self.running and blocks_for(seq.prefill_end + 1, self.pool.block_size) <= self.free_blocks

    def _need(self, seq: Sequence) -> int:
        """Blocks a waiting request takes from the free ones when admitted: its prompt (to recompute, after a
        preemption) and first token, and its growth; less the blocks it will share with requests already
        holding them (a fork's sibling, a cached prefix that some request holds)."""
        end = max(seq.prefill_end + 1, self._growth_end(seq))
        return blocks_for(end, self.pool.block_size) - self._held_elsewhere(seq)

    def _growth_end(self, seq: Sequence) -> int:
        """The positions the request is expected to reach: `growth_ratio` of the tokens it may still write."""
        left = seq.request.max_new_tokens - len(seq.output_ids)
        return min(seq.num_tokens + math.ceil(self.growth_ratio * left), self.max_len)

    def _growth(self, seq: Sequence) -> int:
        """Blocks a running request is expected to take beyond those it holds."""
        held = len(seq.cache.blocks) if seq.cache is not None else 0
        return max(0, blocks_for(max(self._growth_end(seq), seq.prefill_end + 1), self.pool.block_size) - held)

    def _held_elsewhere(self, seq: Sequence) -> int:
        """Whole prompt blocks it will map rather than take: a sibling's, or the prefix cache's that a running
        request also holds (the cache's own are counted among the free ones)."""
        if seq.fork_of is not None:
            return (seq.fork_of.prompt_len - 1) // self.pool.block_size
        if self.prefix is None:
            return 0
        return self.prefix.held_by_requests(seq.tokens(0, seq.num_tokens))

    def _waits_for_sibling(self, seq: Sequence, held: deque[Sequence]) -> bool:
        sibling = seq.fork_of
        if sibling is None:
            return False
        if sibling.prompt_len < 2 or not any(sibling in q for q in (self.running, self.waiting, held)):
            seq.fork_of = None  # nothing to share, or the sibling is gone: prefill in full
            return False
        return sibling.cache is None or sibling.prefilled < sibling.prompt_len - 1

    # --- a step's rows and blocks -------------------------------------------------------
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
        runs out, the running request with the least progress is preempted, until the write fits or its own
        request was."""
        for seq, start, end in writes:
            while seq.cache is not None:
                try:
                    seq.cache.prepare(start, end)
                    break
                except PoolExhausted:
                    self.preempt(self.victim())

    def victim(self) -> Sequence:
        """The running request with the fewest output tokens, the newest among equals: the least work lost, and
        the requests closest to finishing keep their blocks."""
        return min(reversed(self.running), key=lambda s: len(s.output_ids))

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._keep_computed(seq)
        seq.cache.free()
        seq.preempted()
        self.waiting.appendleft(seq)
        self.preemptions += 1
        self.growth_ratio = 1.0  # back to the full reserve: the victim comes back only with room to finish
        self._preempted = True

    def _keep_computed(self, seq: Sequence) -> None:
        """Hand the victim's whole blocks of prompt-path K/V to the prefix cache (if there is one), keyed by their
        tokens: its readmission maps those still cached instead of recomputing them. Decode-written positions
        count only where the policy's decode rows write the prompt path's bits (`Policy.decode_writes_prompt_bits`);
        a margin request's fast-path columns are never kept."""
        if self.prefix is None:
            return
        if seq.prefilling:
            computed = seq.prefilled
        elif seq.policy.decode_writes_prompt_bits:
            computed = seq.last_fed_pos  # the last token's K/V are written by the next step, not yet
        else:
            computed = seq.prompt_len
        self.prefix.store(seq.tokens(0, computed), seq.cache)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
            seq.cache.free()
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
