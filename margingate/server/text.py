"""Released token ids -> the text a client sees: incremental detokenization and stop strings."""
from __future__ import annotations


class TextAssembler:
    """Released token ids -> text deltas; cuts at the first stop string and never emits half a
    character or the start of a possible stop string before it is decided.

    Detokenizes incrementally (a window from the last complete character, as vLLM does), so a long
    answer costs O(n), not O(n^2); the final flush decodes the whole answer once, so the text is
    always exactly decode(token_ids), cut at the first stop string.
    """

    def __init__(self, decode, stops: list[str]):
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.decoded = ""             # complete characters decoded so far
        self.text = ""                # emitted so far
        self.stopped = False

    def feed(self, new_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids += new_ids
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        window = self.decode(self.ids[self.prefix_offset:])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):  # not inside a UTF-8 sequence
            self.decoded += window[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._advance(self.decoded, final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        return self._advance(self.decode(self.ids), final=True)

    def _advance(self, full: str, final: bool) -> str:
        if not full.startswith(self.text):  # the decoder rewrote earlier text: keep what was sent
            return ""
        # a stop string never starts inside emitted text: a possible start is always held back
        cut = min((i for i in (full.find(s, len(self.text)) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._emit(full[:cut])
        end = len(full)
        if not final:
            for s in self.stops:  # hold back a tail that may grow into a stop string
                for k in range(min(len(s) - 1, end - len(self.text)), 0, -1):
                    if full.endswith(s[:k]):
                        end = min(end, len(full) - k)
                        break
        return self._emit(full[:end])

    def _emit(self, upto: str) -> str:
        delta = upto[len(self.text):]
        self.text = upto if len(upto) > len(self.text) else self.text
        return delta
