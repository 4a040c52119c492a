"""`--served-model-name`: the names a server answers to (the first is the one /v1/models lists and answers
carry; every one is accepted as `model`), and the default name of a model served from a file or folder: its own
name without the directory (openai-agents reads a `/` in a model name as a provider prefix and refuses it)."""
from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from server_fixtures import MODEL, TIMEOUT, make_server  # noqa: E402

from margingate.cli import build_parser  # noqa: E402
from margingate.server.core.config import ServerConfig  # noqa: E402
from margingate.serving_context import served_name  # noqa: E402


def test_a_file_or_folder_is_served_by_its_own_name(tmp_path):
    gguf = tmp_path / "models" / "qwen2.5-coder-0.5b-q8_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    assert served_name(str(gguf)) == "qwen2.5-coder-0.5b-q8_0.gguf"
    assert served_name(f"{gguf.parent}/") == "models"
    assert served_name(MODEL) == MODEL                     # a named model, as given
    assert served_name("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"  # not on disk: a Hub id, as given


def test_the_flag_takes_one_or_more_names():
    assert build_parser().parse_args(["serve"]).served_model_name == ()
    assert build_parser().parse_args(["serve", "--served-model-name", "a", "b/c"]).served_model_name == ["a", "b/c"]
    with pytest.raises(ValueError, match="non-empty"):
        ServerConfig(served_model_names=("ok", " "))


def test_every_served_name_is_accepted_and_the_first_is_listed(llm):
    srv = make_server(llm, slots=2, served_model_names=("coder", "gpt-4o-mini"))
    try:
        with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["coder"]
            assert c.get("/v1/models/gpt-4o-mini").json()["id"] == "gpt-4o-mini"
            for name in ("coder", "gpt-4o-mini"):
                r = c.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2})
                assert r.status_code == 200 and r.json()["model"] == "coder", r.text
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            assert c.get(f"/v1/models/{MODEL}").status_code == 404
    finally:
        srv.stop()
