"""What "the same tokenizer as transformers'" means, checked one way for every model: margingate's `Tokenizer`
(the `tokenizers` library on a snapshot, chat templates rendered by models/chat_template.py) against
transformers' AutoTokenizer on the same folder: the ids of texts (with and without special tokens), decoded
text (special tokens kept and skipped, every token alone), chat prompts (tools, keywords, reasoning, a
continued final message) and the streamed text of a token-by-token decode."""
from __future__ import annotations

import random

from margingate.engine.detokenize import Detokenizer

TEXTS = ["Hello world", "  leading and trailing  ", "def f(x):\n\treturn x ** 2  # squared\n",
         "Zahlen 1234567 und 3.14159, ok?", "emoji 🤖👍🏽 and accents: café, naïve, Ångström", "中文 日本語 한국어",
         "<|im_start|>user\nhi<|im_end|>\n", "<|endoftext|> text around <|im_end|>", "don't , they 're here .",
         "\n\n\n   \t  ", "e\u0301 composed vs é", ""]
CHATS = [
    {"messages": [{"role": "user", "content": "What is 2 + 2?"}]},
    {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello.", "tool_calls": None}, {"role": "user", "content": "Bye"}],
     "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "Weather in Paris?"}],
     "tools": [{"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                                  "parameters": {"type": "object",
                                                                 "properties": {"city": {"type": "string"}},
                                                                 "required": ["city"]}}}]},
    {"messages": [{"role": "user", "content": "Solve it"},
                  {"role": "assistant", "content": "The answer is", "reasoning_content": "think"}],
     "add_generation_prompt": False, "continue_final_message": True},
    {"messages": [{"role": "user", "content": "Ünïcödé ✓ \"quoted\" <b>html</b>"}], "enable_thinking": False,
     "custom_flag": [1, 2.5, None]},
]


def check_same_as_transformers(ours, hf, seed: int = 0) -> int:
    """Assert every comparison above on `ours` (margingate's Tokenizer) and `hf` (transformers' tokenizer of the
    same folder); returns how many comparisons ran (a caller asserts it is not zero)."""
    n = 0
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False), text
        assert ours._tok.encode(text, add_special_tokens=True).ids == hf.encode(text, add_special_tokens=True), text
        n += 2
    rng = random.Random(seed)
    vocab = len(hf)
    specials = list(hf.all_special_ids) + [i for i in range(vocab - 300, vocab)]
    for _ in range(40):
        ids = [rng.choice(specials) if rng.random() < 0.2 else rng.randrange(vocab)
               for _ in range(rng.randrange(1, 24))]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids, clean_up=False) == hf.decode(ids, skip_special_tokens=True,
                                                              clean_up_tokenization_spaces=False)
        n += 3
    for i in [*range(0, vocab, max(1, vocab // 997)), *specials]:
        assert ours.token_str(i) == hf.decode([i]), i
        assert ours.token_bytes(i) == _hf_token_bytes(hf, i), i
        n += 2
    if hf.chat_template:
        for chat in CHATS:
            kwargs = {k: v for k, v in chat.items() if k != "messages"}
            kwargs.setdefault("add_generation_prompt", "continue_final_message" not in kwargs)
            ours_text = ours.render_chat([dict(m) for m in chat["messages"]], **kwargs)
            assert ours_text == hf.apply_chat_template(chat["messages"], tokenize=False, **kwargs), chat
            n += 1
    for text in TEXTS:  # streaming: token by token, the released deltas add up to transformers' decode
        ids = hf.encode(text, add_special_tokens=False)
        stream = Detokenizer(lambda w: ours.decode(w, clean_up=False))
        deltas = []
        for k in range(1, len(ids) + 1):
            stream.feed(ids[:k])
            deltas.append(stream.release(k, finished=k == len(ids)))
        whole = hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert "".join(deltas) == stream.final_text() == whole, text
        n += 1
    return n


def _hf_token_bytes(hf, i: int) -> bytes:
    """Today's (before the snapshot) `Tokenizer.token_bytes`, on transformers' tokenizer."""
    from margingate.models.tokenizer import _byte_decoder

    piece, table = hf.convert_ids_to_tokens(i), _byte_decoder()
    if piece and all(c in table for c in piece):
        return bytes(table[c] for c in piece)
    return hf.decode([i]).encode()
