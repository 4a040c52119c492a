"""Logits rows left on the accelerator, with what a greedy row needs read back in one small copy.

A GPU decode step of 32 rows over a 128k vocabulary makes 16 MB of fp32 logits. Reading them back and
choosing on the host costs more than the step itself, so the runner reads back only, per row, its argmax
(ties: the lowest token id, as `invariant.argmax_rows`: torch.argmax returns the first maximum) and the gap
between its two best values in fp32 (MarginGate's margin, the one rounding of one subtraction wherever it
runs). A greedy row with no bias, penalty or grammar chooses from those
(`sampling.choose`); anything else (logprobs, temperature, grammars) reads its rows back with `host`.
"""
from __future__ import annotations

import torch


class DeviceRows:
    """fp32 logits rows [n, vocab] on the device, with `best` (token ids) and `margin` (best value less the
    second best) of each row on the host. Slicing keeps them on the device; an int index reads that row back."""
    __slots__ = ("rows", "best", "margin")

    def __init__(self, rows: torch.Tensor, best: list[int], margin: list[float]):
        self.rows, self.best, self.margin = rows, best, margin

    @classmethod
    def read(cls, logits: torch.Tensor) -> DeviceRows:
        """Summarize rows [n, vocab] (n >= 0, vocab >= 2) with one copy to the host."""
        top = torch.topk(logits, 2, dim=1).values
        summary = torch.stack([logits.argmax(dim=1).double(), (top[:, 0] - top[:, 1]).double()], dim=1)
        best, margin = summary.cpu().T.tolist()  # fp32 gaps and ids below 2^53 are exact in fp64
        return cls(logits, [int(b) for b in best], margin)

    def __len__(self) -> int:
        return self.rows.shape[0]

    @property
    def shape(self) -> torch.Size:
        return self.rows.shape

    def __getitem__(self, index: int | slice) -> DeviceRows | torch.Tensor:
        if isinstance(index, slice):
            return DeviceRows(self.rows[index], self.best[index], self.margin[index])
        return self.rows[index].cpu()

    def cpu(self) -> torch.Tensor:
        return self.rows.cpu()


def host(rows: torch.Tensor | DeviceRows) -> torch.Tensor:
    """Logits rows on the host, read back if they were left on the device."""
    return rows.cpu() if isinstance(rows, DeviceRows) else rows


def margins(rows: torch.Tensor | DeviceRows) -> list[float]:
    """Each row's gap between its best and second-best value."""
    if isinstance(rows, DeviceRows):
        return list(rows.margin)
    top = torch.topk(rows, 2, dim=1).values
    return (top[:, 0] - top[:, 1]).tolist()
