"""Tokenizer with its chat template (the HF tokenizer files in the model folder)."""
from __future__ import annotations

import functools
from pathlib import Path

from ..data.prompts import Prompt


class Tokenizer:
    def __init__(self, folder: Path):
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(folder))
        except Exception as exc:  # noqa: BLE001 - any failure here means the folder lacks a usable tokenizer
            raise FileNotFoundError(f"no usable tokenizer in {folder}: {exc}") from exc
        self.has_chat_template = bool(getattr(self._tok, "chat_template", None))
        self._bytes: dict[int, bytes] = {}

    @property
    def hf(self):
        """The Hugging Face tokenizer underneath (structured output compiles against it)."""
        return self._tok

    def same_vocabulary(self, other: Tokenizer) -> bool:
        """Do both map every token string to the same id (a draft model must share the target's)?"""
        return self._tok.get_vocab() == other._tok.get_vocab()

    def encode_prompt(self, prompt: Prompt, tools: list[dict] | None = None, **template) -> list[int]:
        """Raw text as the tokenizer frames it (Gemma: after <bos>); chat messages through the chat
        template, given `template`'s keywords (add_generation_prompt, default true; anything else the
        template reads). A base model has no template (its GGUF carries none): it continues the messages'
        text, one message per paragraph, as a text-completion engine would."""
        if prompt.kind == "text":
            return self._tok.encode(prompt.text, add_special_tokens=True)
        if not self.has_chat_template:
            return self._tok.encode("\n\n".join(m["content"] for m in prompt.messages), add_special_tokens=True)
        template.setdefault("add_generation_prompt", True)
        text = self._tok.apply_chat_template(list(prompt.messages), tools=tools, tokenize=False,
                                             **template)  # tools: a template with a tool format
        return self.encode(text)  # the template writes the special tokens itself

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_str(self, token_id: int) -> str:
        return self._tok.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (a byte-level BPE piece may be half a character, which `token_str`
        shows as U+FFFD); for other tokenizers, the UTF-8 of its text."""
        if token_id not in self._bytes:
            piece = self._tok.convert_ids_to_tokens(token_id)
            table = _byte_decoder()
            raw = bytes(table[c] for c in piece) if piece and all(c in table for c in piece) else None
            self._bytes[token_id] = raw if raw is not None else self.token_str(token_id).encode()
        return self._bytes[token_id]


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-ins for the 256 byte values, reversed."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars
