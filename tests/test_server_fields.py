"""The fields SDKs send, and the server's small routes, on the embedded model: an unknown field is ignored and
named in a header (a misspelling of ours is still a 400); a field that would change the output and is not
implemented is a 400 naming it; min_tokens holds the end back; the chat template gets its options;
/tokenize and /detokenize in vLLM's shapes; CORS when asked; the environment names llguidance and gguf."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from server_fixtures import MODEL, chat, make_server  # noqa: E402

from margingate.server.protocol.sdk_fields import IGNORED_HEADER  # noqa: E402

BI = {"determinism": {"policy": "batch-invariant"}}


def post(http, route: str, **body):
    return http.post(route, json={"model": MODEL, **body})


def test_unknown_fields_are_ignored_and_named_in_a_header(http):
    plain = post(http, "/v1/chat/completions", messages=chat("Name a colour."), max_tokens=8, **BI)
    extra = post(http, "/v1/chat/completions", messages=chat("Name a colour."), max_tokens=8, **BI,
                 prediction={"type": "content", "content": "red"}, verbosity="low", reasoning_effort="low",
                 store=False, zz_vendor_option=1)
    assert plain.status_code == extra.status_code == 200, extra.text
    assert extra.headers[IGNORED_HEADER] == "prediction, verbosity, zz_vendor_option"  # reasoning_effort is ours
    assert IGNORED_HEADER not in plain.headers
    assert extra.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]
    odd = post(http, "/v1/completions", prompt="Hi", max_tokens=1, **{"line\nbreak": 1, "ünï": 2})
    assert odd.status_code == 200 and odd.headers[IGNORED_HEADER] == "line\\nbreak, \\xfcn\\xef"
    r = post(http, "/v1/completions", prompt="Hi", max_tokens=2, determinsm={"policy": "reference"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "determinsm"
    assert "did you mean 'determinism'" in r.json()["error"]["message"]


@pytest.mark.parametrize("field, value", [("stop_token_ids", [2]), ("skip_special_tokens", False),
                                          ("functions", [{"name": "f"}]), ("include_stop_str_in_output", True),
                                          ("use_beam_search", True), ("allowed_token_ids", [1, 2])])
def test_fields_that_would_change_the_output_are_refused_by_name(http, field, value):
    r = post(http, "/v1/chat/completions", messages=chat("x"), max_tokens=2, **{field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_neutral_values_of_unsupported_fields_pass(http):
    r = post(http, "/v1/chat/completions", messages=chat("x"), max_tokens=2, skip_special_tokens=True,
             stop_token_ids=[], include_stop_str_in_output=False, modalities=["text"])
    assert r.status_code == 200, r.text


def test_min_tokens_holds_the_end_back(http):
    """Greedy: the same tokens up to where the answer ended, then more instead of the end."""
    ask = dict(messages=chat("What is 2 + 2?"), max_tokens=64, **BI)
    short = post(http, "/v1/chat/completions", **ask).json()["choices"][0]
    assert short["finish_reason"] == "stop" and len(short["token_ids"]) < 40, short  # else the test shows nothing
    n = len(short["token_ids"]) + 8
    longer = post(http, "/v1/chat/completions", **ask, min_tokens=n).json()["choices"][0]
    assert len(longer["token_ids"]) >= n and longer["token_ids"][:len(short["token_ids"]) - 1] \
        == short["token_ids"][:-1]
    assert short["token_ids"][-1] not in longer["token_ids"][:n]  # the end token, held back
    for body, param in (({"min_tokens": 65}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
                        ({"min_tokens": 2, "response_format": {"type": "json_object"}}, "min_tokens")):
        r = post(http, "/v1/chat/completions", **{**ask, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_the_chat_template_gets_its_options(http):
    def ids(**kw):
        r = post(http, "/tokenize", messages=[*chat("The capital of France?"), *kw.pop("more", [])], **kw)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]
    full, bare = ids(), ids(add_generation_prompt=False)
    head = post(http, "/tokenize", prompt="<|im_start|>assistant\n", add_special_tokens=False).json()["tokens"]
    assert full == bare + head  # SmolLM2's generation prompt
    assert ids(chat_template_kwargs={"unused_by_this_template": 1}, reasoning_effort="high") == full
    cont = ids(more=[{"role": "assistant", "content": "Paris is"}], add_generation_prompt=False,
               continue_final_message=True)
    assert post(http, "/detokenize", tokens=cont).json()["prompt"].endswith("assistant\nParis is")
    answer = post(http, "/v1/chat/completions", messages=chat("The capital of France?"), max_tokens=2,
                  add_generation_prompt=False)
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == len(bare)
    r = post(http, "/v1/chat/completions", messages=chat("x"), chat_template_kwargs={"tools": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_tokenize_and_detokenize_in_vllms_shapes(http, server):
    r = post(http, "/tokenize", prompt="Hello world", return_token_strs=True).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == server.engine.max_len
    assert post(http, "/detokenize", tokens=r["tokens"]).json() == {"prompt": "Hello world"}
    echo = post(http, "/v1/completions", prompt="Hello world", max_tokens=0, echo=True).json()
    assert echo["choices"][0]["prompt_token_ids"] == r["tokens"]
    messages = chat("What is 2 + 2?")
    counted = post(http, "/tokenize", messages=messages).json()["count"]
    assert counted == post(http, "/v1/chat/completions", messages=messages, max_tokens=1).json()["usage"][
        "prompt_tokens"]
    for route, body in (("/detokenize", {"tokens": [10 ** 9]}), ("/detokenize", {"tokens": "abc"}),
                        ("/tokenize", {"prompt": 5}), ("/tokenize", {})):
        assert post(http, route, **body).status_code == 400, (route, body)


def test_cors_origins_when_asked(llm, http):
    from margingate.cli import build_parser

    given = build_parser().parse_args(["serve", "--cors-origins", "http://a.test", "http://b.test"]).cors_origins
    assert given == ["http://a.test", "http://b.test"] and build_parser().parse_args(["serve"]).cors_origins == ()
    assert "access-control-allow-origin" not in http.get("/v1/models", headers={"Origin": "http://a.test"}).headers
    import httpx

    srv = make_server(llm, slots=2, api_key="k", cors_origins=("http://a.test",))
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            pre = c.options("/v1/chat/completions", headers={"Origin": "http://a.test",
                                                             "Access-Control-Request-Method": "POST",
                                                             "Access-Control-Request-Headers": "authorization"})
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://a.test"
            got = c.get("/v1/models", headers={"Origin": "http://a.test", "Authorization": "Bearer k"})
            assert got.status_code == 200 and got.headers["access-control-allow-origin"] == "http://a.test"
            other = c.get("/v1/models", headers={"Origin": "http://b.test", "Authorization": "Bearer k"})
            assert "access-control-allow-origin" not in other.headers
    finally:
        srv.stop()


def test_the_environment_names_llguidance_and_gguf(http):
    report = post(http, "/v1/completions", prompt="Hi", max_tokens=1).json()["determinism"]
    assert {"llguidance", "gguf"} <= set(report["environment"]["packages"])
