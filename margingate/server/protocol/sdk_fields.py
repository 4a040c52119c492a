"""The fields clients send that this server does not act on, sorted by what ignoring them would do.

- A field that changes no token here (or that we do not know) is ignored, and named in the
  `x-margingate-ignored-fields` response header and the log: rejecting such fields broke clients
  (vLLM moved from rejecting to accepting them, its #10463).
- A field that would change the tokens or the text and that we do not implement is a 400 naming it,
  unless it has its neutral value (`UNSUPPORTED`).
- An unknown field spelt almost like one of ours is a 400 that names ours: a misspelt `determinism`
  must not silently run undeterministic.
"""
from __future__ import annotations

import difflib
from typing import Any

IGNORED_HEADER = "x-margingate-ignored-fields"

# field -> (the values that change nothing, why any other is refused)
UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "suffix": ((None, ""), "suffix (insertion) is not supported"),
    "functions": ((None, []), "functions (the legacy form of tools) is not supported: send tools"),
    "function_call": ((None, "none", "auto"), "function_call (the legacy form of tool_choice) is not supported: "
                                              "send tool_choice"),
    "stop_token_ids": ((None, []), "stop_token_ids is not supported: send stop strings"),
    "bad_words": ((None, []), "bad_words is not supported: use logit_bias"),
    "allowed_token_ids": ((None,), "allowed_token_ids is not supported: use logit_bias or a grammar"),
    "include_stop_str_in_output": ((None, False), "include_stop_str_in_output is not supported"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "length_penalty": ((None, 1, 1.0), "length_penalty (beam search) is not supported"),
    "skip_special_tokens": ((None, True), "skip_special_tokens false is not supported: the text leaves special "
                                          "tokens out (token_ids has every token)"),
    "spaces_between_special_tokens": ((None, True), "spaces_between_special_tokens false is not supported"),
    "truncate_prompt_tokens": ((None,), "truncate_prompt_tokens is not supported: a prompt too long is refused"),
    "guided_whitespace_pattern": ((None,), "guided_whitespace_pattern is not supported"),
    "return_tokens_as_token_ids": ((None, False), "return_tokens_as_token_ids is not supported (token_ids has "
                                                  "them)"),
    "modalities": ((None, ["text"]), "only the text modality is supported"),
    "audio": ((None,), "audio output is not supported"),
    "web_search_options": ((None,), "web search is not supported"),
    "documents": ((None, []), "documents is not supported"),
}
# chat only: completions implements echo
CHAT_UNSUPPORTED = {"echo": ((None, False), "echo is not supported on chat (use /v1/completions with echo)")}

# Keys of chat_template_kwargs that are apply_chat_template's own arguments, or fields of the body.
RESERVED_TEMPLATE_KEYS = frozenset({"messages", "conversation", "tools", "documents", "chat_template", "tokenize",
                                    "add_generation_prompt", "continue_final_message", "return_dict",
                                    "return_tensors", "padding", "truncation", "max_length"})


def refuse_unsupported(body: Any, table: dict[str, tuple[tuple, str]]) -> None:
    """Raises ValueError ("field: why") for the first field of `table` the body sets to a value that acts."""
    if not isinstance(body, dict):
        return
    for name, (neutral, why) in table.items():
        # same type too: false is not 0, and 1 is listed beside 1.0 where both mean the same
        if name in body and not any(type(body[name]) is type(v) and body[name] == v for v in neutral):
            raise ValueError(f"{name}: {why}")


def check_unknown(extra: dict[str, Any], known) -> None:
    """Raises ValueError naming an unknown field that looks like a misspelling of a known one."""
    for name in extra:
        close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.85)
        if close:
            raise ValueError(f"{name}: unknown field (did you mean {close[0]!r}?)")


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    for key in kwargs or {}:
        if key in RESERVED_TEMPLATE_KEYS:
            raise ValueError(f"chat_template_kwargs: {key!r} is set by the request itself, not by the template's "
                             f"arguments")


def header_value(names: list[str], limit: int = 32) -> str:
    """The ignored fields as one header line: printable ASCII, escaped (a name is any JSON string; a header
    is latin-1 without line breaks), at most `limit` names."""
    shown = [n.encode("unicode_escape").decode("ascii")[:64] for n in names[:limit]]
    return ", ".join(shown) + (f", (+{len(names) - limit} more)" if len(names) > limit else "")
