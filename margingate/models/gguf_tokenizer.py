"""The tokenizer metadata of a GGUF written from a Hugging Face folder (`gguf_export.py`), as
llama.cpp's convert_hf_to_gguf.py writes it for a byte-level (GPT-2 style) BPE tokenizer:
tokenizer.ggml.model "gpt2", the pre-tokenizer's name, every token with its type, and the merges,
special token ids, add_*_token flags and chat template that the `gguf` package's `SpecialVocab`
reads from tokenizer.json, tokenizer_config.json / chat_template.jinja and config.json.

Other tokenizers (SentencePiece's, as Llama 2 and Mistral v0.1 ship) are refused by name.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

# convert_hf_to_gguf.py names a tokenizer's pre-tokenizer by a hash of how it tokenizes a test
# text. Here a known vocabulary is named by a hash of its tokens (in id order, as written), and any
# other by the split its tokenizer.json declares (a converted GGUF's tokenizer.json may not carry
# SmolLM's digit split, hence the hash).
KNOWN_VOCABS = {"d1f2ce856b324081b621d9e2e8dbd22879f462329f3fd4aa39fa758dddb2ce55": "smollm"}  # SmolLM2's
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
KNOWN_SPLITS = {  # a Split pre-tokenizer's regex -> llama.cpp's name for it
    _WORDS + r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",
    _WORDS + r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",
}


def _steps(tok: dict) -> list[dict]:
    pre = tok.get("pre_tokenizer") or {}
    return pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre] if pre else []


def is_byte_level_bpe(tok: dict) -> bool:
    """A GPT-2 style tokenizer: BPE over bytes mapped to printable characters."""
    return (tok.get("model") or {}).get("type") == "BPE" and (
        any(s.get("type") == "ByteLevel" for s in _steps(tok)) or (tok.get("decoder") or {}).get("type") == "ByteLevel")


def pre_tokenizer(tok: dict, tokens: list[str]) -> str:
    """llama.cpp's name (tokenizer.ggml.pre) for how `tok` splits text before BPE."""
    name = KNOWN_VOCABS.get(hashlib.sha256("\n".join(tokens).encode()).hexdigest())
    if name:
        return name
    steps = _steps(tok)
    kinds = [s.get("type") for s in steps]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"  # digits one by one, then GPT-2's split
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    regexes = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
    if len(regexes) == 1 and regexes[0] in KNOWN_SPLITS:
        return KNOWN_SPLITS[regexes[0]]
    # The bench hands llama.cpp token ids, never text, so its own split does not change what it computes.
    warnings.warn(f"pre-tokenizer {kinds} is not one llama.cpp is known to name: tokenizer.ggml.pre = default",
                  stacklevel=2)
    return "default"


def _looks_special(token: str) -> bool:
    # convert_hf_to_gguf.py: some models mark control tokens as not special
    return token.startswith("<|") and token.endswith("|>")


def vocabulary(tok: dict, n_vocab: int, source: Path) -> tuple[list[str], list[int]]:
    """Every token id below `n_vocab` (the embedding's rows): its text and llama.cpp token type; ids
    the tokenizer leaves unused are padding, as convert_hf_to_gguf.py writes them."""
    from gguf import TokenType

    added = {t["id"]: t for t in tok.get("added_tokens", [])}
    by_id = {i: t for t, i in tok["model"]["vocab"].items()} | {i: t["content"] for i, t in added.items()}
    if by_id and max(by_id) >= n_vocab:
        raise ValueError(f"{source}: token id {max(by_id)} is outside the model's vocabulary of {n_vocab}")
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        elif i in added and (added[i].get("special") or _looks_special(by_id[i])):
            tokens.append(by_id[i])
            types.append(TokenType.CONTROL)
        elif i in added:
            tokens.append(by_id[i].replace("\u2581", " "))  # user-defined tokens are matched pre-normalized
            types.append(TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def add_tokenizer(writer, folder: Path, n_vocab: int) -> None:
    """Write the tokenizer of HF folder `folder` into the GGUF `writer`."""
    import gguf

    path = Path(folder) / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"{folder} has no tokenizer.json: llama.cpp needs the tokenizer inside the GGUF")
    tok = json.loads(path.read_text(encoding="utf-8"))
    if not is_byte_level_bpe(tok):
        kind = (tok.get("model") or {}).get("type")
        raise ValueError(f"{folder}: its tokenizer ({kind}, pre-tokenizer {[s.get('type') for s in _steps(tok)]}) "
                         "is not a byte-level (GPT-2 style) BPE; only those are written into a GGUF here")
    tokens, types = vocabulary(tok, n_vocab, folder)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer(tok, tokens))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab).add_to_gguf(writer, quiet=True)
