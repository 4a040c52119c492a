"""Stop strings, cut at the token that completes one.

The rule, the same under every policy, with speculation on or off, alone or under load: a request
ends at the shortest prefix of its output whose text contains one of its stop strings. Its token
ids, logprobs and usage end with the token that completes the stop string; the text a client sees
is cut before the stop string (`server/text.py`). The engine applies it to every token it appends,
before any is released, so what a policy's release burst or a speculative step happens to hold
past the stop is never handed out: the cut is a function of the tokens alone.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence


class StopStrings:
    def __init__(self, strings: Sequence[str], decode: Callable[[list[int]], str]):
        self.strings, self.decode = tuple(strings), decode

    def _found(self, ids: list[int]) -> bool:
        text = self.decode(ids)
        return any(s in text for s in self.strings)

    def completing(self, ids: list[int]) -> int | None:
        """How many of `ids` to keep: the shortest prefix whose text holds a stop string (None: none
        does). One decode per call while no stop string is there (every step); a bisection once one
        is, since a prefix that holds a stop string stays holding it as tokens are added."""
        if not ids or not self._found(ids):
            return None
        lo, hi = 1, len(ids)  # the prefix of hi tokens holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if self._found(ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return hi
