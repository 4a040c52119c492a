"""Logprobs in OpenAI's response shapes: the legacy completions object (tokens, token_logprobs,
top_logprobs, text_offset) and chat's `content` list (token, logprob, bytes, top_logprobs), which is also the
Responses API's output_text `logprobs`.

The numbers are the engine's `TokenLogprob`s unchanged: fp32 values printed as the shortest
repr of their double, so equal bits give equal JSON."""
from __future__ import annotations

from ...engine.detokenize import char_offsets, decode_text
from ...engine.logprobs import TokenLogprob


class LogprobFormatter:
    def __init__(self, tokenizer, lock):
        self.tokenizer, self.lock = tokenizer, lock

    def text(self, token: int) -> str:
        with self.lock:
            return self.tokenizer.token_str(token)

    def bytes(self, token: int) -> list[int]:
        with self.lock:
            return list(self.tokenizer.token_bytes(token))

    def offsets(self, ids: list[int]) -> list[int]:
        """Where each token's text begins in the text of `ids` (a prompt's, for echo)."""
        with self.lock:
            return char_offsets(lambda window: decode_text(self.tokenizer, window), ids)

    def completion(self, ids: list[int], entries: list[TokenLogprob | None], offsets: list[int]) -> dict:
        """The legacy object for tokens `ids` (an entry None: the prompt's first token, which has none);
        `offsets`: each token's `text_offset`, in characters of the response's text. A token holding part
        of a character adds nothing to the offset until the token that completes the character (so four
        byte tokens of an emoji share one offset and the next token's is one further), as vLLM's and
        OpenAI's offsets count characters of the text returned."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": list(offsets)}
        for token, entry in zip(ids, entries):
            out["tokens"].append(self.text(token))
            out["token_logprobs"].append(None if entry is None else entry.logprob)
            out["top_logprobs"].append(None if entry is None else self._top(entry))
        return out

    def _top(self, entry: TokenLogprob) -> dict[str, float]:
        top: dict[str, float] = {}
        for t, lp in entry.top:  # two tokens with one text: the likelier one's logprob
            top.setdefault(self.text(t), lp)
        return top

    def chat(self, entries: list[TokenLogprob]) -> dict:
        return {"content": self.tokens(entries)}

    def tokens(self, entries: list[TokenLogprob]) -> list[dict]:
        """One entry per token: token, logprob, bytes, top_logprobs (chat's `content`, Responses' `logprobs`)."""
        return [{**self._token(e.token, e.logprob), "top_logprobs": [self._token(t, lp) for t, lp in e.top]}
                for e in entries]

    def _token(self, token: int, logprob: float) -> dict:
        return {"token": self.text(token), "logprob": logprob, "bytes": self.bytes(token)}


def merge_completion(parts: list[dict]) -> dict:
    """Concatenate legacy objects (echo's prompt part, then the completion's)."""
    return {key: [x for part in parts for x in part[key]] for key in parts[0]}
