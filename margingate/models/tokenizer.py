"""Tokenizer with its chat template (the HF tokenizer files in the model folder)."""
from __future__ import annotations

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

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if prompt.kind == "text":
            return self.encode(prompt.text)
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; use {\"text\": ...} prompts")
        text = self._tok.apply_chat_template(list(prompt.messages), tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_str(self, token_id: int) -> str:
        return self._tok.decode([token_id])
