"""Structured output: what a request's text must match, and the token mask that holds it there.

A request names one constraint (`StructuredOutput`, vLLM's structured outputs): a JSON schema, any
JSON object, a regex, a choice of strings or a grammar (Lark, or GBNF). llguidance (a maintained
grammar engine, the one behind Guidance and one of vLLM's backends) compiles it against the
model's tokenizer and gives, for the tokens emitted so far, the set of tokens that may come next.

The mask is a function of the request's own tokens before the row's position, like the penalties:
the sampler applies it after bias and penalties and before temperature, filters and noise, and a
masked token gets -inf, so the ties rule is unchanged. A request's `Matcher` follows its output
ids wherever they go (a strict policy's rollback, a stop-string cut, a verifier replaying earlier
positions): it rolls back to the common prefix and consumes the rest, so the mask of a position
never depends on the order the engine asked for it in.
"""
from __future__ import annotations

import threading
from dataclasses import fields

import numpy as np
import torch

from ..options.structured import StructuredError, StructuredOutput

__all__ = ["AfterReasoning", "Grammars", "Matcher", "StructuredError", "StructuredOutput", "masked"]


class AfterReasoning(StructuredOutput):
    """A constraint that holds the output from where its reasoning ends: the tokens up to and including
    `closing` (a reasoning model's `</think>`, as token ids) are free. `opening` (its `<think>`) empty: the
    output starts inside the reasoning (the prompt opened it); given: the output may open it with its first
    tokens, or start the constrained answer at once."""

    def __init__(self, constraint: StructuredOutput, opening: tuple[int, ...], closing: tuple[int, ...]):
        super().__init__(**{f.name: getattr(constraint, f.name) for f in fields(constraint)})
        if not closing:
            raise StructuredError("structured", "a reasoning's closing needs at least one token")
        object.__setattr__(self, "opening", tuple(opening))
        object.__setattr__(self, "closing", tuple(closing))

class Grammars:
    """Compiles constraints against one tokenizer; the tokenizer's table is built on first use (~1 s)."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 64):
        self.text_tokenizer, self.vocab_size, self.cache_size = tokenizer, vocab_size, cache_size
        self._tokenizer = None
        self._compiled: dict[tuple[str, str], str] = {}
        self._special: dict[str, bool] = {}
        # The server's request threads compile while the engine thread reads: the cache and the tokenizer's
        # one-time build are guarded (two evictions at once were a KeyError, a 500: issue 47). Compiling
        # itself runs outside the lock: it is a pure function of the constraint.
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                # what llguidance.hf.from_tokenizer builds from transformers' wrapper: the Rust tokenizer's JSON
                self._tokenizer = llguidance.LLTokenizer(self.text_tokenizer.backend_json(), n_vocab=self.vocab_size,
                                                         eos_token=self.text_tokenizer.eos_token_id)
            return self._tokenizer

    def is_special(self, text: str) -> bool:
        """Whether `text` is one token that llguidance reads as a special token (an added token, such as Qwen's
        `<tool_call>`): a grammar must name it (`<tool_call>` in Lark, unquoted), since llguidance refuses that
        token where the grammar spells the text, though its mask offers it."""
        tokenizer = self.tokenizer
        with self._lock:
            if text not in self._special:
                ids = self.text_tokenizer.encode(text)
                self._special[text] = len(ids) == 1 and tokenizer.is_special_token(ids[0])
            return self._special[text]

    def compile(self, constraint: StructuredOutput) -> str:
        """llguidance's grammar for the constraint, checked; raises StructuredError naming its field."""
        import llguidance

        key = constraint.source()
        with self._lock:
            grammar = self._compiled.get(key)
        if grammar is not None:
            return grammar
        try:
            grammar = llguidance.grammar_from(*key)
        except (ValueError, TypeError) as exc:
            raise StructuredError(constraint.option, f"{constraint.option}: {exc}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise StructuredError(constraint.option, f"{constraint.option} does not compile: {error}")
        with self._lock:
            if key not in self._compiled and len(self._compiled) >= self.cache_size:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[key] = grammar
        return grammar

    def matcher(self, constraint: StructuredOutput) -> Matcher | ReasonedMatcher:
        import llguidance

        matcher = Matcher(llguidance.LLMatcher(self.tokenizer, self.compile(constraint), log_level=0),
                          self.vocab_size)
        if isinstance(constraint, AfterReasoning):
            return ReasonedMatcher(matcher, constraint.opening, constraint.closing)
        return matcher


class Matcher:
    """One request's grammar state, kept in step with the tokens it is asked about."""

    def __init__(self, matcher, vocab_size: int):
        self.ll, self.vocab_size = matcher, vocab_size
        self._start = matcher.deep_copy()  # the grammar's start, for starting over (reset keeps an error)
        self.consumed: list[int] = []
        self._mask: torch.Tensor | None = None  # the mask after `consumed`, once computed
        self.error: str | None = None
        self._error_at = 0  # with an error: how many tokens of `consumed` the grammar took before it

    def _follow(self, tokens: list[int]) -> None:
        common = 0
        for a, b in zip(self.consumed, tokens):
            if a != b:
                break
            common += 1
        if common < len(self.consumed):
            if self.error is not None and common <= self._error_at:
                # the refused token is rolled back (a repair, a rollback, a replay): the error goes with it,
                # and the grammar follows the tokens again from its start (a matcher in error cannot roll back)
                self.ll = self._start.deep_copy()
                self.consumed, self.error, common = [], None, 0
            elif self.error is None:
                self.ll.rollback(len(self.consumed) - common)
            del self.consumed[common:]  # in error past _error_at, the grammar took none of these
            self._mask = None
        for token in tokens[common:]:
            if self.error is None and not self.ll.consume_token(token):
                self.error = self.ll.get_error() or f"token {token} is outside the grammar"
                self._error_at = len(self.consumed)
            self.consumed.append(token)
            self._mask = None

    def allowed(self, tokens: list[int], stop_ids: frozenset[int]) -> torch.Tensor:
        """The tokens that may follow `tokens` (bool, one per vocabulary entry). A matcher in error (a
        resource limit, a token it refused) allows only the stop tokens: the request ends, alone."""
        self._follow(tokens)
        if self.error is None and self.ll.is_error():
            self.error, self._error_at = self.ll.get_error(), len(self.consumed)
        if self.error is not None:
            only = torch.zeros(self.vocab_size, dtype=torch.bool)
            only[[t for t in stop_ids if t < self.vocab_size]] = True
            return only
        if self._mask is None:
            bits = np.frombuffer(self.ll.compute_bitmask(), dtype=np.uint8)
            self._mask = torch.from_numpy(np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool))
        return self._mask


class ReasonedMatcher:
    """A `Matcher` whose grammar starts after the output's reasoning (`AfterReasoning`): every token is
    allowed inside it; the grammar follows the tokens after its closing. Where the output may open a
    reasoning, its first token is the grammar's or the opening's, and an opening begun is finished."""

    def __init__(self, matcher: Matcher, opening: tuple[int, ...], closing: tuple[int, ...]):
        self.inner, self.opening, self.closing = matcher, list(opening), list(closing)
        self.free = torch.ones(matcher.vocab_size, dtype=torch.bool)

    @property
    def error(self) -> str | None:
        return self.inner.error

    def allowed(self, tokens: list[int], stop_ids: frozenset[int]) -> torch.Tensor:
        n = len(self.opening)
        if n and tokens[:n] != self.opening:
            if tokens and self.opening[:len(tokens)] == tokens:  # an opening begun
                only = torch.zeros_like(self.free)
                only[self.opening[len(tokens)]] = True
                return only
            if not tokens:  # the answer at once, or its reasoning
                mask = self.inner.allowed([], stop_ids).clone()
                mask[self.opening[0]] = True
                return mask
            return self.inner.allowed(tokens, stop_ids)  # no reasoning: the grammar from the first token
        end = self._answer_start(tokens, n)
        return self.free if end is None else self.inner.allowed(tokens[end:], stop_ids)

    def _answer_start(self, tokens: list[int], begin: int) -> int | None:
        """Where the answer begins (after the reasoning's closing), None while the reasoning goes on."""
        k = len(self.closing)
        for i in range(begin, len(tokens) - k + 1):
            if tokens[i:i + k] == self.closing:
                return i + k
        return None


def masked(seq, rows: torch.Tensor, first_position: int) -> torch.Tensor:
    """Rows choosing the tokens at first_position, first_position + 1, ... with the grammar's mask:
    a token it does not allow gets -inf."""
    out = rows.clone()
    for i in range(rows.shape[0]):
        tokens = seq.output_ids[:first_position + i - seq.prompt_len]
        out[i].masked_fill_(~seq.grammar.allowed(tokens, seq.stop_ids), -torch.inf)
    return out
