"""Row-independence of whole forwards (verifier passes, prompt prefills in any split), and
the KV cache and rollback bookkeeping beneath the policies. The kernels' own row tests are
in `test_kernels.py`."""
from __future__ import annotations

import pytest
import torch

from margingate.engine.policy import VerifyJob
from margingate.engine.runner import Runner
from margingate.engine.sequence import Request, Sequence
from margingate.engine.verifier import Verifier
from margingate.models.decoder import AttentionPlan
from margingate.models.kv_cache import KVCache
from margingate.policies import VerifyState

# --- KVCache -----------------------------------------------------------------------


def small_cache(dtype=torch.bfloat16) -> KVCache:
    kv = KVCache(num_layers=3, num_slots=4, max_len=8, num_kv_heads=2, head_dim=5, dtype=dtype, device="cpu")
    g = torch.Generator().manual_seed(0)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    return kv


def test_kv_column_round_trip():
    """A slot's view reads a copy of one position across every layer; overwriting puts it
    back elsewhere and touches nothing else."""
    kv = small_cache()
    k0, v0 = kv.k.clone(), kv.v.clone()
    col = kv.view(1).read(5)
    assert col[0].shape == col[1].shape == (3, 2, 5)
    assert torch.equal(col[0], k0[:, 1, :, 5]) and torch.equal(col[1], v0[:, 1, :, 5])

    kv.k.zero_()  # a copy, not a view: later cache writes leave it alone
    assert torch.equal(col[0], k0[:, 1, :, 5])
    kv.k.copy_(k0)

    kv.view(2).overwrite(3, col)
    back = kv.view(2).read(3)
    assert torch.equal(back[0], col[0]) and torch.equal(back[1], col[1])
    k0[:, 2, :, 3], v0[:, 2, :, 3] = col
    assert torch.equal(kv.k, k0) and torch.equal(kv.v, v0)


def test_kv_write_rows_land_at_slot_and_position():
    """`write` stores N (slot, position) rows of one layer, cast to the cache dtype."""
    kv = small_cache()
    before_k = kv.k.clone()
    k = torch.randn(2, 2, 5)
    v = torch.randn(2, 2, 5)
    kv.write(1, torch.tensor([3, 0]), torch.tensor([7, 2]), k, v)
    assert torch.equal(kv.k[1, 3, :, 7], k[0].to(torch.bfloat16))
    assert torch.equal(kv.v[1, 0, :, 2], v[1].to(torch.bfloat16))
    before_k[1, 3, :, 7], before_k[1, 0, :, 2] = k.to(torch.bfloat16)
    assert torch.equal(kv.k, before_k)


def test_kv_slots_lowest_first_and_bounded():
    """Slots are handed out lowest first, released ones come back, a full cache refuses."""
    kv = KVCache(1, 3, 4, 1, 2, torch.bfloat16, "cpu")
    assert [kv.allocate() for _ in range(3)] == [0, 1, 2] and kv.num_free == 0
    with pytest.raises(RuntimeError, match="no free KV slot"):
        kv.allocate()
    kv.release(2)
    kv.release(0)
    assert kv.num_free == 2 and kv.allocate() == 0


# --- Sequence.rollback ---------------------------------------------------------------


def test_sequence_rollback():
    """rollback(n) keeps the first n tokens (prompt included) and lowers `released` to match;
    neither the cache (stale columns are never read) nor the policy's state is touched: the
    policy that rolls back owns its state."""
    kv = small_cache()
    k_before = kv.k.clone()
    seq = Sequence(Request([11, 12, 13], max_new_tokens=10), policy=None, stop_ids=frozenset(), cache=kv.view(1))
    seq.state = VerifyState(canonical_len=7, flagged={6, 7})
    seq.output_ids = [21, 22, 23, 24, 25]
    seq.released = 5
    assert (seq.num_tokens, seq.last_fed_pos, seq.token_at(1), seq.token_at(4), seq.slot) == (8, 7, 12, 22, 1)
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


def new_cache(model, slots: int, max_len: int = 192) -> KVCache:
    c = model.config
    return KVCache(c.num_layers, slots, max_len, c.num_kv_heads, c.head_dim, torch.bfloat16, "cpu")


def prefill(model, kv: KVCache, slot: int, ids: list[int]) -> None:
    n = len(ids)
    model.forward(torch.tensor(ids), torch.arange(n), torch.full((n,), slot), AttentionPlan.all_exact(n), kv,
                  logits_rows=slice(n - 1, n))


def columns(kv: KVCache, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kv.k[:, slot, :, start:end].clone(), kv.v[:, slot, :, start:end].clone()


@pytest.fixture(scope="module")
def chunk_case(llm, prompts):
    """Two prompts, a chunk of k positions to verify after the first, and that chunk
    decoded the slow way: one single-row exact forward per position (decoding alone)."""
    model, tok = llm.model, llm.tokenizer
    a, b = tok.encode_prompt(prompts[0]), tok.encode_prompt(prompts[2])
    chunk = tok.encode(" First, 17 * 24 = 408. Then 156 / 12 = 13, so")
    k, p = len(chunk), len(a)
    kv = new_cache(model, 1)
    prefill(model, kv, 0, a)
    rows = [model.forward(torch.tensor([t]), torch.tensor([p + i]), torch.tensor([0]), AttentionPlan(exact=[0]), kv)[0]
            for i, t in enumerate(chunk)]
    return {"a": a, "b": b, "chunk": chunk, "k": k, "logits": torch.stack(rows), "kv": columns(kv, 0, p, p + k)}


def test_verifier_chunk_equals_one_at_a_time(llm, chunk_case):
    """bf16: k positions verified in one pass (each row exact over its own prefix) give
    the same logits and K/V, bitwise, as decoding them one position at a time."""
    model, c = llm.model, chunk_case
    p, k = len(c["a"]), c["k"]
    kv = new_cache(model, 1)
    prefill(model, kv, 0, c["a"])
    logits = model.forward(torch.tensor(c["chunk"]), torch.arange(p, p + k), torch.zeros(k, dtype=torch.long),
                           AttentionPlan(exact=list(range(k))), kv)
    assert torch.equal(logits, c["logits"])
    got = columns(kv, 0, p, p + k)
    assert torch.equal(got[0], c["kv"][0]) and torch.equal(got[1], c["kv"][1])


def test_verifier_rows_unchanged_beside_another_request(llm, chunk_case):
    """The same chunk verified in one pass interleaved with another request's rows (other
    slot, other length): its logits and K/V are bitwise unchanged."""
    model, c = llm.model, chunk_case
    a, b, chunk = c["a"], c["b"], c["chunk"]
    p, q, k = len(a), len(b), c["k"]
    other = [b[-1 - i] for i in range(k + 3)]  # any tokens will do for the neighbour
    kv = new_cache(model, 3)
    prefill(model, kv, 2, a)  # another slot than in the one-at-a-time run
    prefill(model, kv, 0, b)
    tokens, positions, slots, mine = [], [], [], []
    for i in range(k + 3):  # B's rows first, then alternating
        if i < k:
            mine.append(len(tokens) + 1)
        tokens += [other[i]] + ([chunk[i]] if i < k else [])
        positions += [q + i] + ([p + i] if i < k else [])
        slots += [0] + ([2] if i < k else [])
    logits = model.forward(torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots),
                           AttentionPlan(exact=list(range(len(tokens)))), kv)
    assert torch.equal(logits[mine], c["logits"])
    got = columns(kv, 2, p, p + k)
    assert torch.equal(got[0], c["kv"][0]) and torch.equal(got[1], c["kv"][1])


def test_verifier_jobs_equal_one_at_a_time(llm, chunk_case):
    """`Verifier.recompute` with two requests' jobs in one pass returns, for the chunk's job, the
    logits of decoding its positions one at a time, and writes the same K/V."""
    model, c = llm.model, chunk_case
    a, b, chunk = c["a"], c["b"], c["chunk"]
    p, k = len(a), c["k"]
    kv = new_cache(model, 3)
    verifier = Verifier(Runner(model, kv))  # the runner takes slot 0 as its scratch slot
    seqs = []
    for slot, ids, out in ((2, b, b[:5]), (1, a, chunk)):
        s = Sequence(Request(ids, max_new_tokens=32), policy=None, stop_ids=frozenset(), cache=kv.view(slot))
        s.output_ids = list(out)
        prefill(model, kv, slot, ids)
        seqs.append(s)
    jobs = [VerifyJob(seqs[0], len(b), len(b) + 4), VerifyJob(seqs[1], p, p + k - 1)]
    out = verifier.recompute(jobs)
    assert out[0].shape[0] == 5 and torch.equal(out[1], c["logits"])
    got = columns(kv, 1, p, p + k)
    assert torch.equal(got[0], c["kv"][0]) and torch.equal(got[1], c["kv"][1])


# --- prefill in any split -----------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_whole(llm, prompts):
    """One prompt prefilled whole, alone: its K/V and its last row's logits."""
    ids = llm.tokenizer.encode_prompt(prompts[1])
    kv = new_cache(llm.model, 1)
    n = len(ids)
    logits = llm.model.forward(torch.tensor(ids), torch.arange(n), torch.zeros(n, dtype=torch.long),
                               AttentionPlan.all_exact(n), kv, logits_rows=slice(n - 1, n))
    return ids, columns(kv, 0, 0, n), logits[0]


@pytest.mark.parametrize("chunk", [1, 7, 32, 33])
def test_prompt_kv_equal_whole_chunked_token_by_token(llm, prompt_whole, chunk):
    """The prompt fed in chunks of 1 (token by token), 7, 32 and 33 positions, each chunk one
    forward beside another request's rows, into another slot: the same K/V at every position
    and the same last logits, bitwise, as the whole prompt prefilled alone."""
    ids, (k_whole, v_whole), last = prompt_whole
    model, n = llm.model, len(ids)
    kv = new_cache(model, 3)
    other = ids[::-1][:5]
    prefill(model, kv, 0, other)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        tokens = [other[start % 5]] + ids[start:end]  # a neighbour's decode row first
        positions = [5 + start] + list(range(start, end))
        slots = [0] + [2] * (end - start)
        logits = model.forward(torch.tensor(tokens), torch.tensor(positions), torch.tensor(slots),
                               AttentionPlan.all_exact(len(tokens)), kv)
    k, v = columns(kv, 2, 0, n)
    assert torch.equal(k, k_whole) and torch.equal(v, v_whole)
    assert torch.equal(logits[-1], last)
