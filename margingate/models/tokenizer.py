"""The model's tokenizer and chat template, on the `tokenizers` library alone.

What it loads is transformers' own tokenizer of the folder, kept once (tokenizer_snapshot.py), and the chat
template renders as transformers renders it (chat_template.py): the same ids and text as transformers'
AutoTokenizer, without importing transformers at a start. Its methods only read the Rust tokenizer (`&self`
calls), so threads may share it: no private copy for the engine thread.
"""
from __future__ import annotations

import functools
from pathlib import Path

from ..data.prompts import Prompt
from . import chat_template, tokenizer_snapshot

CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
            (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))  # transformers' clean_up_tokenization


class Tokenizer:
    def __init__(self, folder: Path):
        path, self.meta = tokenizer_snapshot.snapshot(Path(folder))
        self._tok = tokenizer_snapshot.load(path)
        self._tok.encode_special_tokens = self.meta["split_special_tokens"]
        self.chat_template: str | dict | None = self.meta["chat_template"]
        self.has_chat_template = bool(self.chat_template)
        self.harmony = chat_template.is_harmony(self.chat_template)  # its answers keep their marks (decode_text)
        self.eos_token_id: int | None = self.meta["eos_token_id"]
        self._bytes: dict[int, bytes] = {}

    def same_vocabulary(self, other: Tokenizer) -> bool:
        """Do both map every token string to the same id (a draft model must share the target's)?"""
        return self._tok.get_vocab(with_added_tokens=True) == other._tok.get_vocab(with_added_tokens=True)

    def backend_json(self) -> str:
        """The Rust tokenizer serialized (llguidance reads the same string transformers' wrapper hands it)."""
        return self._tok.to_str()

    def encode_prompt(self, prompt: Prompt, tools: list[dict] | None = None, **template) -> list[int]:
        """Raw text as the tokenizer frames it (Gemma: after <bos>); chat messages through the chat
        template, given `template`'s keywords (add_generation_prompt, default true; anything else the
        template reads). A base model has no template (its GGUF carries none): it continues the messages'
        text, one message per paragraph, as a text-completion engine would."""
        if prompt.kind == "text":
            return self._tok.encode(prompt.text, add_special_tokens=True).ids
        if not self.has_chat_template:
            return self._tok.encode("\n\n".join(m["content"] for m in prompt.messages), add_special_tokens=True).ids
        template.setdefault("add_generation_prompt", True)
        return self.encode(self.render_chat(list(prompt.messages), tools, **template))

    def render_chat(self, messages: list, tools: list[dict] | None = None, **template) -> str:
        """The chat template's text for `messages` (transformers' apply_chat_template(tokenize=False))."""
        return chat_template.render(self._template(tools), messages, tools=tools,
                                    special_tokens=self.meta["special_tokens"], **template)

    def _template(self, tools) -> str:
        t = self.chat_template
        if isinstance(t, dict):  # named templates: transformers' choice
            name = "tool_use" if tools is not None and "tool_use" in t else "default"
            if name not in t:
                raise ValueError(f"this model has several chat templates and no default: {sorted(t)}")
            return t[name]
        if not t:
            raise ValueError("this model has no chat template")
        return t

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`text`'s ids, no special tokens added (a template writes its own), or with them as the tokenizer's
        post-processor adds them (a decoder embedding a bare text, as transformers' encode does)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True, clean_up: bool | None = None) -> str:
        """transformers' decode: clean_up None is the tokenizer's own setting (off for BPE tokenizers)."""
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self.meta["clean_up"] if clean_up is None else clean_up:
            for before, after in CLEAN_UP:
                text = text.replace(before, after)
        return text

    def token_str(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (a byte-level BPE piece may be half a character, which `token_str`
        shows as U+FFFD); for other tokenizers, the UTF-8 of its text."""
        if token_id not in self._bytes:
            piece = self._tok.id_to_token(token_id)
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
