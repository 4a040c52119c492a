"""One request's output text, built token by token: the one text pipeline (engine, server, `LLM`, CLI).

The text of a request is a function of its token ids alone, whatever the path that appended them
(alone, batched, a speculative step accepting several at once, rolled back and redone): tokens are fed
one at a time, so the state after k tokens depends only on the first k, and each token's prefix is
tested for a stop string.

- Incremental, as vLLM's `detokenize_incrementally`: each token decodes a short window (from
  `prefix`, the start of the token before the last complete one) and emits what the window adds past
  the characters already emitted, so a long answer costs O(n), not O(n^2). The window gives a
  SentencePiece decoder the context of its leading space.
- Complete characters only: a byte-level token may hold half a UTF-8 character, which decodes as
  U+FFFD; a trailing run of those is held until a later token completes it (or the request ends: the
  rest is then flushed, U+FFFD included, as a whole decode would show it).
- No `clean_up_tokenization_spaces`: that rewrites " ," as "," and so is not prefix-monotone (text
  already emitted would change); the stream's text is the concatenation of its tokens' text, as vLLM's.
- Stop strings: after each token, the bounded tail that can hold a new occurrence (the new characters
  and `max(len(stop)) - 1` before them) is searched; the first token whose text completes one ends the
  output (`stop_at`) and the text is cut before it (`cut`). Its token ids, logprobs and usage end with
  that token.
- Rollback (a policy's repair): each token's state is kept, so dropping tokens restores it exactly.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

Decode = Callable[[list[int]], str]
PARTIAL = "\ufffd"  # what a decode shows for bytes of a character not yet complete


def decode_text(tokenizer, ids: list[int]) -> str:
    """The text of `ids` (`models.tokenizer.Tokenizer`'s), as every request's text is built: no special tokens
    (but where the chat template writes harmony, gpt-oss's format, whose marks are special tokens:
    server/parsers/harmony.py reads them), no space clean-up."""
    return tokenizer.decode(ids, skip_special_tokens=not tokenizer.harmony, clean_up=False)


def text_decoder(tokenizer) -> Decode:
    """`decode_text` on the model's tokenizer. No private copy: its decode only reads the Rust tokenizer, which
    threads may share (transformers' wrapper set padding and truncation at each call, hence the copy it needed)."""
    return functools.partial(decode_text, tokenizer)


class _Mark(NamedTuple):
    """The state after some tokens: the window starts at token `prefix`; tokens from `read` on have text
    not yet all emitted; the window's decode begins with `done` characters already in `text`."""
    prefix: int
    read: int
    done: int
    chars: int      # len(text)


class Detokenizer:
    """One request's text and stop strings (the module's docstring says how)."""

    def __init__(self, decode: Decode, stops: Sequence[str] = ()):
        self.decode, self.stops = decode, tuple(stops)
        self.reach = max((len(s) for s in self.stops), default=1) - 1  # chars before new text a stop may start at
        self.ids: list[int] = []
        self.text = ""                      # complete characters of the tokens fed
        self.marks = [_Mark(0, 0, 0, 0)]    # marks[k]: the state after k tokens
        self.stop_at: int | None = None     # tokens up to the one that completed a stop string
        self.cut: int | None = None         # where the text ends: before that stop string
        self.sent = 0                       # characters handed to the caller (`release`)

    def __len__(self) -> int:
        return len(self.ids)

    def feed(self, ids: Sequence[int]) -> int | None:
        """Append the tokens past those already fed, one at a time, up to the first that completes a stop
        string. Returns `stop_at` (None: no stop string so far)."""
        for token in ids[len(self.ids):]:
            if self.stop_at is not None:
                break
            self._append(token)
        return self.stop_at

    def _append(self, token: int) -> None:
        self.ids.append(token)
        mark, before = self.marks[-1], len(self.text)
        window = self.decode(self.ids[mark.prefix:])
        complete = window.rstrip(PARTIAL)
        if len(complete) > mark.done:
            self.text += complete[mark.done:]
        if len(complete) < len(window):  # a character is still incomplete: the window keeps growing
            self.marks.append(mark._replace(done=max(mark.done, len(complete)), chars=len(self.text)))
        else:  # all emitted: the next window starts where this token's run began (context for its first)
            prefix = mark.read
            self.marks.append(_Mark(prefix, len(self.ids), len(self.decode(self.ids[prefix:])), len(self.text)))
        if self.stops and len(self.text) > before:
            self._check(max(0, before - self.reach))

    def _check(self, start: int) -> None:
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.stop_at, self.cut = len(self.ids), min(found)

    def rollback(self, n: int) -> None:
        """Keep the first n tokens (a policy replaced the others)."""
        n = min(n, len(self.ids))
        del self.ids[n:], self.marks[n + 1:]
        self.text = self.text[:self.marks[n].chars]
        if self.stop_at is not None and self.stop_at > n:
            self.stop_at = self.cut = None

    def offsets(self, start: int, end: int) -> list[int]:
        """Where the text of each token in [start, end) begins, in characters: a token holding part of a
        character adds nothing until the one completing it (completions' `text_offset`)."""
        return [self.marks[i].chars for i in range(start, end)]

    def release(self, n: int, finished: bool) -> str:
        """The text of the first n tokens not handed out yet (streaming: the deltas add up to `final_text`)."""
        text, end = self._upto(n, finished)
        delta = text[self.sent:end]
        self.sent = max(self.sent, end)
        return delta

    def final_text(self) -> str:
        """The whole text of the tokens fed, cut before the stop string."""
        text, end = self._upto(len(self.ids), finished=True)
        return text[:end]

    def _upto(self, n: int, finished: bool) -> tuple[str, int]:
        """The text of the first n tokens and how much of it may go out: until the request finishes, a tail
        that may grow into a stop string is held back; once finished, everything up to the cut, with the
        partial character the request may end on."""
        if self.cut is not None and n >= self.stop_at:
            return self.text, self.cut
        mark = self.marks[n]
        text = self.text[:mark.chars]
        if finished:
            text += self.decode(self.ids[mark.prefix:n])[mark.done:]
            return text, len(text)
        return text, len(text) - self._held(text)

    def _held(self, text: str) -> int:
        """The longest end of `text` that begins a stop string (and may yet complete it)."""
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)


def char_offsets(decode: Decode, ids: Sequence[int]) -> list[int]:
    """Each token's `text_offset` in the text of `ids` (a prompt's, for echo)."""
    d = Detokenizer(decode)
    d.feed(ids)
    return d.offsets(0, len(ids))
