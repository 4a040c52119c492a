"""Row-independence of whole forwards (verifier passes, prompt prefills in any split), and
the KV cache and rollback bookkeeping beneath the policies. The kernels' own row tests are
in `test_kernels.py`."""
from __future__ import annotations

import pytest
import torch
from kv_helpers import request_pool, span

from margingate.engine.policy import VerifyJob
from margingate.engine.runner import Runner
from margingate.engine.sequence import Request, Sequence
from margingate.engine.verifier import Verifier
from margingate.models.decoder import AttentionPlan
from margingate.models.kv_cache import BlockRefError, BlockTable, KVPool, PoolExhausted
from margingate.policies import VerifyState

# --- KVPool and BlockTable ----------------------------------------------------------------


def small_pool(dtype="bfloat16", blocks=6) -> KVPool:
    """3 layers, `blocks` blocks of 4 positions, 2 KV heads of 8; every block random."""
    pool = KVPool(num_layers=3, num_blocks=blocks, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    pool.k.copy_(torch.randn(pool.k.shape, generator=g))
    pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    return pool


def test_column_round_trip_through_a_block_table():
    """A table reads a copy of one position across every layer from the block and row the position maps to;
    overwriting puts it back elsewhere and touches nothing else."""
    pool = small_pool()
    a, b = BlockTable(pool, [4, 1]), BlockTable(pool, [2, 0])
    pool.refs[:] = [1] * pool.num_blocks
    k0, v0 = pool.k.clone(), pool.v.clone()
    col = a.read(5)  # position 5: block a[1] = 1, row 1
    assert col[0].shape == col[1].shape == (3, 2, 8)
    assert torch.equal(col[0], k0[:, 1, :, 1]) and torch.equal(col[1], v0[:, 1, :, 1])
    pool.k.zero_()  # a copy, not a view
    assert torch.equal(col[0], k0[:, 1, :, 1])
    pool.k.copy_(k0)
    b.overwrite(3, col)  # block b[0] = 2, row 3
    k0[:, 2, :, 3], v0[:, 2, :, 3] = col
    assert torch.equal(pool.k, k0) and torch.equal(pool.v, v0)


def test_write_rows_land_at_their_block_and_row():
    """`write` stores N rows of one layer at (table, position): block table[position // B], row position % B."""
    pool = small_pool()
    before = pool.k.clone()
    tables = torch.tensor([[3, 5], [0, -1]])
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    pool.write(1, tables, torch.tensor([0, 1]), torch.tensor([6, 2]), k, v)
    assert torch.equal(pool.k[1, 5, :, 2], k[0].to(torch.bfloat16))
    assert torch.equal(pool.v[1, 0, :, 2], v[1].to(torch.bfloat16))
    before[1, 5, :, 2], before[1, 0, :, 2] = k.to(torch.bfloat16)
    assert torch.equal(pool.k, before)


def test_blocks_lowest_first_freed_reused_and_bounded():
    """Blocks are handed out lowest first and zeroed, a freed one comes back first, a full pool refuses."""
    pool = small_pool(blocks=3)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2] and pool.num_free == 0
    assert not pool.k[:, :3].any()
    with pytest.raises(PoolExhausted, match="3 blocks are all in use"):
        pool.allocate()
    pool.release(2)
    pool.release(0)
    assert pool.num_free == 2 and pool.allocate() == 0


def test_shared_blocks_are_counted_and_copied_on_write():
    """A fork shares its sibling's blocks (each counted twice); a write into a shared block copies it first
    and leaves the sibling's bytes alone; freeing both returns every block."""
    pool = small_pool(blocks=8)
    a = BlockTable.empty(pool)
    a.prepare(0, 7)  # 7 positions: blocks 0 and 1
    pool.k[:, a.blocks[1]] = 1.0
    fork = BlockTable.empty(pool)
    fork.share(a, 6)
    assert fork.blocks == a.blocks and [pool.refs[b] for b in a.blocks] == [2, 2]
    fork.prepare(6, 8)  # position 6 lies in the shared block 1
    assert fork.blocks[0] == a.blocks[0] and fork.blocks[1] != a.blocks[1]
    assert [pool.refs[b] for b in (*a.blocks, fork.blocks[1])] == [2, 1, 1]
    assert torch.equal(pool.k[:, fork.blocks[1]], pool.k[:, a.blocks[1]])  # the copy has the shared rows
    fork.overwrite(6, (torch.zeros(3, 2, 8), torch.zeros(3, 2, 8)))
    assert bool((pool.k[:, a.blocks[1], :, 2] == 1.0).all())
    a.truncate(3)  # rolled back to 3 positions: its second block goes back
    assert len(a.blocks) == 1 and pool.num_free == 8 - 2  # block 0, shared, and the fork's copy
    a.free()
    fork.free()
    assert pool.num_free == 8 and not any(pool.refs)


# --- Sequence.rollback ---------------------------------------------------------------


def test_sequence_rollback():
    """rollback(n) keeps the first n tokens (prompt included) and lowers `released` to match;
    neither the cache (stale columns are never read; the engine frees whole blocks past the end after
    the step) nor the policy's state is touched: the
    policy that rolls back owns its state."""
    kv = small_pool()
    k_before = kv.k.clone()
    seq = Sequence(Request([11, 12, 13], max_new_tokens=10), policy=None, stop_ids=frozenset(),
                   cache=BlockTable(kv, [1, 2]))
    seq.state = VerifyState(canonical_len=7, flagged={6, 7})
    seq.output_ids = [21, 22, 23, 24, 25]
    seq.released = 5
    assert (seq.num_tokens, seq.last_fed_pos, seq.token_at(1), seq.token_at(4)) == (8, 7, 12, 22)
    assert seq.tokens(2, 5) == [13, 21, 22]

    seq.rollback(5)
    assert seq.output_ids == [21, 22]
    assert seq.num_tokens == 5 and seq.last_fed_pos == 4 and seq.next_pos == 5
    assert seq.released == 2
    assert torch.equal(kv.k, k_before)
    assert seq.state.canonical_len == 7 and seq.state.flagged == {6, 7}
    seq.state.verified_through(5)  # what a verifying policy does after its rollback
    assert seq.state.canonical_len == 5 and not seq.state.flagged

    seq.released = 1
    seq.rollback(4)  # never raises released
    assert seq.output_ids == [21] and seq.released == 1

    with pytest.raises(ValueError, match="prompt"):
        seq.rollback(3)


# --- the verifier's rows -------------------------------------------------------------


def new_cache(model, slots: int, max_len: int = 192) -> tuple[KVPool, torch.Tensor]:
    """A pool and `slots` block tables of `max_len` positions (slot s: table s)."""
    return request_pool(model.config, slots, max_len)


def prefill(model, kv: KVPool, tables: torch.Tensor, slot: int, ids: list[int]) -> None:
    n = len(ids)
    model.forward(torch.tensor(ids), torch.arange(n), tables, torch.full((n,), slot),
                  AttentionPlan.all_exact(n), kv,
                  logits_rows=slice(n - 1, n))


def columns(kv: KVPool, tables: torch.Tensor, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    return span(kv, tables[slot], start, end)


@pytest.fixture(scope="module")
def chunk_case(llm, prompts):
    """Two prompts, a chunk of k positions to verify after the first, and that chunk
    decoded the slow way: one single-row exact forward per position (decoding alone)."""
    model, tok = llm.model, llm.tokenizer
    a, b = tok.encode_prompt(prompts[0]), tok.encode_prompt(prompts[2])
    chunk = tok.encode(" First, 17 * 24 = 408. Then 156 / 12 = 13, so")
    k, p = len(chunk), len(a)
    kv, tables = new_cache(model, 1)
    prefill(model, kv, tables, 0,
            a)
    rows = [model.forward(torch.tensor([t]), torch.tensor([p + i]), tables, torch.tensor([0]),
                          AttentionPlan(exact=[0]), kv)[0]
            for i, t in enumerate(chunk)]
    return {"a": a, "b": b, "chunk": chunk, "k": k, "logits": torch.stack(rows), "kv": columns(kv, tables, 0, p, p + k)}


def test_verifier_chunk_equals_one_at_a_time(llm, chunk_case):
    """bf16: k positions verified in one pass (each row exact over its own prefix) give
    the same logits and K/V, bitwise, as decoding them one position at a time."""
    model, c = llm.model, chunk_case
    p, k = len(c["a"]), c["k"]
    kv, tables = new_cache(model, 1)
    prefill(model, kv, tables, 0, c["a"])
    logits = model.forward(torch.tensor(c["chunk"]), torch.arange(p, p + k), tables, torch.zeros(k, dtype=torch.long),
                           AttentionPlan(exact=list(range(k))), kv)
    assert torch.equal(logits, c["logits"])
    got = columns(kv, tables, 0, p, p + k)
    assert torch.equal(got[0], c["kv"][0]) and torch.equal(got[1], c["kv"][1])


def test_verifier_rows_unchanged_beside_another_request(llm, chunk_case):
    """The same chunk verified in one pass interleaved with another request's rows (other
    slot, other length): its logits and K/V are bitwise unchanged."""
    model, c = llm.model, chunk_case
    a, b, chunk = c["a"], c["b"], c["chunk"]
    p, q, k = len(a), len(b), c["k"]
    other = [b[-1 - i] for i in range(k + 3)]  # any tokens will do for the neighbour
    kv, tables = new_cache(model, 3)
    prefill(model, kv, tables, 2, a)  # another slot than in the one-at-a-time run
    prefill(model, kv, tables, 0, b)
    tokens, positions, slots, mine = [], [], [], []
    for i in range(k + 3):  # B's rows first, then alternating
        if i < k:
            mine.append(len(tokens) + 1)
        tokens += [other[i]] + ([chunk[i]] if i < k else [])
        positions += [q + i] + ([p + i] if i < k else [])
        slots += [0] + ([2] if i < k else [])
    logits = model.forward(torch.tensor(tokens), torch.tensor(positions), tables, torch.tensor(slots),
                           AttentionPlan(exact=list(range(len(tokens)))), kv)
    assert torch.equal(logits[mine], c["logits"])
    got = columns(kv, tables, 2, p, p + k)
    assert torch.equal(got[0], c["kv"][0]) and torch.equal(got[1], c["kv"][1])


def test_verifier_jobs_equal_one_at_a_time(llm, chunk_case):
    """`Verifier.recompute` with two requests' jobs in one pass returns, for the chunk's job, the
    logits of decoding its positions one at a time, and writes the same K/V."""
    model, c = llm.model, chunk_case
    a, b, chunk = c["a"], c["b"], c["chunk"]
    p, k = len(a), c["k"]
    kv, tables = new_cache(model, 3)
    verifier = Verifier(Runner(model, kv))
    seqs = []
    for slot, ids, out in ((2, b, b[:5]), (1, a, chunk)):
        s = Sequence(Request(ids, max_new_tokens=32), policy=None, stop_ids=frozenset(),
                     cache=BlockTable(kv, tables[slot].tolist()))
        s.output_ids = list(out)
        prefill(model, kv, tables, slot, ids)
        seqs.append(s)
    jobs = [VerifyJob(seqs[0], len(b), len(b) + 4), VerifyJob(seqs[1], p, p + k - 1)]
    out = verifier.recompute(jobs)
    assert out[0].shape[0] == 5 and torch.equal(out[1], c["logits"])
    got = columns(kv, tables, 1, p, p + k)
    assert torch.equal(got[0], c["kv"][0]) and torch.equal(got[1], c["kv"][1])


# --- prefill in any split -----------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_whole(llm, prompts):
    """One prompt prefilled whole, alone: its K/V and its last row's logits."""
    ids = llm.tokenizer.encode_prompt(prompts[1])
    kv, tables = new_cache(llm.model, 1)
    n = len(ids)
    logits = llm.model.forward(torch.tensor(ids), torch.arange(n), tables, torch.zeros(n, dtype=torch.long),
                               AttentionPlan.all_exact(n), kv, logits_rows=slice(n - 1, n))
    return ids, columns(kv, tables, 0, 0, n), logits[0]


@pytest.mark.parametrize("chunk", [1, 7, 32, 33])
def test_prompt_kv_equal_whole_chunked_token_by_token(llm, prompt_whole, chunk):
    """The prompt fed in chunks of 1 (token by token), 7, 32 and 33 positions, each chunk one
    forward beside another request's rows, into another slot: the same K/V at every position
    and the same last logits, bitwise, as the whole prompt prefilled alone."""
    ids, (k_whole, v_whole), last = prompt_whole
    model, n = llm.model, len(ids)
    kv, tables = new_cache(model, 3)
    other = ids[::-1][:5]
    prefill(model, kv, tables, 0, other)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        tokens = [other[start % 5]] + ids[start:end]  # a neighbour's decode row first
        positions = [5 + start] + list(range(start, end))
        slots = [0] + [2] * (end - start)
        logits = model.forward(torch.tensor(tokens), torch.tensor(positions), tables, torch.tensor(slots),
                               AttentionPlan.all_exact(len(tokens)), kv)
    k, v = columns(kv, tables, 2, 0, n)
    assert torch.equal(k, k_whole) and torch.equal(v, v_whole)
    assert torch.equal(logits[-1], last)


def test_free_blocks_hand_their_pages_back_and_held_blocks_keep_their_bytes():
    """An idle pool's free blocks give their whole pages back (they then read zeros, which `allocate` would
    write anyway); a held block, and the pages it shares with free neighbours, keep every byte."""
    from margingate.models.kv_cache import KVPool, release_pages

    pool = KVPool(2, 64, 16, 2, 64)  # 4 KiB of K per block and layer: one page each on x86-64
    for t in pool.tensors()[:2]:
        t.fill_(1.0)
    held = [pool.allocate() for _ in range(3)]
    for t in pool.tensors()[:2]:
        for block in held:
            t[:, block] = 7.0
    released = pool.release_free_pages()
    if released == 0:
        assert release_pages(pool.k.data_ptr(), pool.k.numel() * 2) == 0  # no madvise here: nothing to show
        return
    free = [b for b in range(64) if b not in held]
    assert released >= 2 * 2 * (len(free) - 2) * pool.k[0, 0].numel() * 2  # all but the pages at a run's ends
    for t in pool.tensors()[:2]:
        assert bool((t[:, held] == 7.0).all())
        assert int((t[:, free] == 0).sum()) >= 0.9 * t[:, free].numel()


def test_a_double_free_is_refused_loudly():
    """Releasing a block that holds no reference would put it on the free list twice, and two requests would
    later share it silently: it raises, and the free list stays as it was. Sharing a free block raises too."""
    pool = small_pool(blocks=4)
    table = BlockTable.empty(pool)
    table.prepare(0, 6)  # blocks 0 and 1
    table.free()
    assert pool.num_free == 4
    with pytest.raises(BlockRefError, match="released twice"):
        pool.release(0)
    with pytest.raises(BlockRefError, match="is free"):
        pool.retain(1)
    assert pool.num_free == 4 and sorted(pool._free) == [0, 1, 2, 3] and not any(pool.refs)
    assert sorted(pool.allocate() for _ in range(4)) == [0, 1, 2, 3]  # each block handed out once
