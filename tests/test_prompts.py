import json
from importlib import resources

import pytest

from margingate.data.prompts import (
    Prompt,
    PromptFileError,
    builtin_prompts,
    load_prompts_file,
    parse_prompt_record,
)


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- builtin set ---------------------------------------------------------------


def test_builtin_prompts_cover_categories_and_kinds():
    prompts = builtin_prompts()
    assert len(prompts) >= 32
    assert {p.kind for p in prompts} == {"chat", "text"}
    assert all(p.source.startswith("builtin:") for p in prompts)
    # at least one multi-message (system + user) conversation
    assert any(p.messages and p.messages[0]["role"] == "system" for p in prompts)

    raw = resources.files("margingate.data").joinpath("builtin_prompts.jsonl").read_text("utf-8")
    categories = {json.loads(line).get("category") for line in raw.splitlines() if line.strip()}
    assert {"math", "code", "chat", "instruction"} <= categories


def test_builtin_display_is_short_single_line():
    for p in builtin_prompts():
        d = p.display()
        assert d and "\n" not in d and len(d) <= 60


# --- parsing each form ---------------------------------------------------------


def test_parse_prompt_form():
    p = parse_prompt_record({"prompt": "Hi there", "category": "chat"}, "x:1")
    assert p == Prompt("chat", ({"role": "user", "content": "Hi there"},), None, "x:1")


def test_parse_messages_form():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    p = parse_prompt_record({"messages": msgs, "extra": 1}, "x:2")
    assert p.kind == "chat" and p.text is None
    assert p.messages == tuple(msgs)
    assert p.display() == "Why?"


def test_parse_text_form():
    p = parse_prompt_record({"text": "Once upon a time"}, "x:3")
    assert p == Prompt("text", None, "Once upon a time", "x:3")


def test_display_collapses_whitespace_and_truncates():
    p = parse_prompt_record({"prompt": "a  b\n\tc " + "x" * 100}, "x:1")
    d = p.display()
    assert d.startswith("a b c x") and len(d) == 60 and d.endswith("…")


def test_load_file_skips_blank_lines_and_records_sources(tmp_path):
    f = write_lines(tmp_path / "p.jsonl", ['{"prompt": "one"}', "", "   ", '{"text": "two"}'])
    prompts = load_prompts_file(f)
    assert [p.kind for p in prompts] == ["chat", "text"]
    assert [p.source for p in prompts] == [f"{f}:1", f"{f}:4"]


# --- error paths ---------------------------------------------------------------


@pytest.mark.parametrize(
    "obj, fragment",
    [
        (["prompt"], "expected a JSON object"),
        ({"category": "math", "foo": "bar"}, 'expected one of "prompt", "messages" or "text"'),
        ({"prompt": "a", "text": "b"}, "only one of"),
        ({"prompt": 42}, '"prompt" must be a non-empty string'),
        ({"prompt": "   "}, '"prompt" must be a non-empty string'),
        ({"text": ""}, '"text" must be a non-empty string'),
        ({"messages": []}, '"messages" must be a non-empty list'),
        ({"messages": "hello"}, '"messages" must be a non-empty list'),
        ({"messages": ["hello"]}, "messages[0] must be an object"),
        ({"messages": [{"role": "bot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ],
)
def test_parse_rejects_bad_records(obj, fragment):
    with pytest.raises(PromptFileError) as exc:
        parse_prompt_record(obj, "prompts.jsonl:3")
    msg = str(exc.value)
    assert msg.startswith("prompts.jsonl:3: ") and fragment in msg


def test_bad_json_names_file_and_line(tmp_path):
    f = write_lines(tmp_path / "bad.jsonl", ['{"prompt": "ok"}', "", '{"prompt": oops}'])
    with pytest.raises(PromptFileError, match=r"bad\.jsonl:3: invalid JSON"):
        load_prompts_file(f)


def test_bad_record_in_file_names_line(tmp_path):
    f = write_lines(tmp_path / "p.jsonl", ['{"prompt": "ok"}', '{"category": "math"}'])
    with pytest.raises(PromptFileError, match=r"p\.jsonl:2: expected one of"):
        load_prompts_file(f)


def test_missing_file(tmp_path):
    with pytest.raises(PromptFileError, match="prompt file not found"):
        load_prompts_file(tmp_path / "nope.jsonl")


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path, content):
    f = tmp_path / "empty.jsonl"
    f.write_text(content, encoding="utf-8")
    with pytest.raises(PromptFileError, match="no prompts"):
        load_prompts_file(f)


# --- encoding ----------------------------------------------------------------------


def test_a_base_model_continues_the_messages_as_text(model_dir, tmp_path):
    """A tokenizer without a chat template (a base model's GGUF carries none) encodes chat prompts
    as the text of their messages, one per paragraph, framed as raw text is; with the template the
    same prompt is a chat turn."""
    import shutil

    from margingate.models.tokenizer import Tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):  # everything but chat_template.jinja
        shutil.copy(model_dir / name, tmp_path / name)
    base, chat = Tokenizer(tmp_path), Tokenizer(model_dir)
    assert not base.has_chat_template and chat.has_chat_template
    prompt = parse_prompt_record({"messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "Name a prime."}]}, "t:1")
    assert base.encode_prompt(prompt) == base.encode("Be brief.\n\nName a prime.")
    assert chat.encode_prompt(prompt) != base.encode_prompt(prompt)
    assert base.encode_prompt(parse_prompt_record({"text": "Name a prime."}, "t:2")) == base.encode("Name a prime.")
