"""When a proposal pays: a two-number model of the decode forward, fitted from the step profile as it runs.

A decode forward over n rows costs about `fixed + per_row * n`. `fixed` is mostly reading the
weights once, which is why a small batch on a large model is memory-bound; `per_row` is the
arithmetic each row adds. Over the batch, one token costs t(n) / n, and an accepted proposal saves
one token. A request whose proposals are accepted at rate p keeps its j-th proposal with
probability about p^j. So that proposal pays while p^j * t(n) / n exceeds per_row plus the time
spent proposing one token. With B = 1 on a large model, t(n) / n is far above per_row, and even a
poor proposer pays. With a large batch, t(n) / n falls toward per_row, and only near-certain
proposals pay.

The model only decides how many rows a step feeds. The tokens are the plain tokens whatever it
decides (speculative.py), so a bad fit costs time, never a token.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepProfile:
    """A decayed least-squares fit of seconds = fixed + per_row * rows over the decode-only steps."""
    decay: float = 0.97   # about the last 30 steps count: context grows, batches change
    _w: float = 0.0       # the decayed sums: weight, rows, seconds, rows^2, rows * seconds
    _n: float = 0.0
    _t: float = 0.0
    _nn: float = 0.0
    _nt: float = 0.0
    _last: int | None = None  # the row count of the last step observed
    #: a proposal must save this much more than its row costs: the fit is an estimate, and a
    #: proposal that only breaks even on paper loses to the fit's error and the bookkeeping
    margin: float = 1.2

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self._w, self._n, self._t = d * self._w + 1, d * self._n + rows, d * self._t + seconds
        self._nn, self._nt = d * self._nn + rows * rows, d * self._nt + rows * seconds
        self._last = rows

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_row) in seconds, or None while the steps seen do not tell them apart (every
        step had the same row count)."""
        var = self._nn * self._w - self._n * self._n
        if self._w < 2 or var <= 1e-9 * self._w * self._w:
            return None
        per_row = (self._nt * self._w - self._n * self._t) / var
        fixed = (self._t - per_row * self._n) / self._w
        return max(fixed, 0.0), max(per_row, 0.0)

    def worth(self, rate: float, rows: int, k: int, propose_seconds: float = 0.0) -> int:
        """How many of up to k proposals pay for a request accepted at `rate`, in a forward that
        already has `rows` rows. Until the fit exists it explores at the cost of one row: one
        proposal when this step would otherwise repeat the last step's row count, so the next
        observation differs (feeding every proposal to find out cost up to 9x a step at B = 16)."""
        fit = self.fit()
        if fit is None:
            return min(k, 1) if rows == self._last or self._last is None else 0
        fixed, per_row = fit
        kept = 0
        for j in range(1, k + 1):  # the j-th proposal: its row joins the forward
            n = rows + j
            if rate ** j * (fixed / n + per_row) <= self.margin * (per_row + propose_seconds):
                break
            kept = j
        return kept
