"""The contract's one assertion and its one reference: a request's tokens equal, bitwise, those of the
same prompt decoded alone (a batch of one) by the reference policy on the session engine. (The controls
hold other policies to their own request alone.)"""
from __future__ import annotations

from collections.abc import Sequence

from margingate.engine import Request

CONTEXT = 3  # tokens shown either side of the first difference


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """The first index where the two differ (a length difference counts at the shorter's end); None if equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def assert_same_tokens(results: Sequence, want: Sequence[Sequence[int]], what: str) -> None:
    """Each result's `token_ids` equal its `want`, bitwise. Otherwise one AssertionError naming `what` and,
    for every request that differs, its id, the first differing index and the tokens around it."""
    if len(results) != len(want):
        raise AssertionError(f"{what}: {len(results)} results for {len(want)} references")
    lines = []
    for r, w in zip(results, want):
        got, w = list(r.token_ids), list(w)
        i = first_difference(got, w)
        if i is not None:
            lo, hi = max(0, i - CONTEXT), i + CONTEXT + 1
            lines.append(f"  request {r.request_id}: first difference at token {i} (of {len(got)} got, {len(w)} "
                         f"wanted): got [{lo}:{hi}] {got[lo:hi]}, alone {w[lo:hi]}")
    if lines:
        raise AssertionError(f"{what}: {len(lines)} of {len(want)} requests differ from the request alone\n"
                             + "\n".join(lines))


class Alone:
    """Each prompt decoded alone by `policy` (default `reference`) on the session engine, `max_new_tokens`
    tokens, EOS ignored: for `reference`, the trajectory every deterministic policy promises. Computed once
    per prompt and shared by every case; a shorter request's is a prefix of it (greedy decoding)."""

    def __init__(self, llm, max_new_tokens: int, policy: str = "reference"):
        self.llm, self.max_new_tokens, self.policy = llm, max_new_tokens, policy
        self._done: dict[tuple[int, ...], list[int]] = {}

    def tokens(self, prompt_ids: Sequence[int], n: int) -> list[int]:
        if n > self.max_new_tokens:
            raise ValueError(f"the request alone has {self.max_new_tokens} tokens, {n} asked")
        key = tuple(prompt_ids)
        if key not in self._done:
            req = Request(list(prompt_ids), self.max_new_tokens, self.llm.policy(self.policy), ignore_eos=True,
                          request_id="alone")
            self._done[key] = self.llm.engine.generate([req])[0].token_ids
        return self._done[key][:n]

    def of(self, results: Sequence, n: int) -> list[list[int]]:
        """The first `n` tokens of each result's prompt decoded alone."""
        return [self.tokens(r.prompt_ids, n) for r in results]
