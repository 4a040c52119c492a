"""The RL surface of the server (server/core/control.py, server/core/pause.py; docs/serving.md, "RL: weights,
pauses, token ids"), on the embedded model at bf16 through a real uvicorn: weights from a folder or a state dict
equal a fresh load of them bitwise, bad weights change nothing, an update during a stream follows its mode and loses
no request, /pause, /resume, /reset_prefix_cache, `return_token_ids`, logprobs modes, `n` seeds, ids outside the
vocabulary.

The module serves its own bf16 facade's model (`rl_llm`): the updates here replace that model's weights, never the
session's. Each test that swaps weights puts the loaded ones back before it ends.
"""
from __future__ import annotations

import json
import shutil
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from server_fixtures import MODEL, TIMEOUT, is_idle, make_server, poll, sse_events  # noqa: E402

BI = {"policy": "batch-invariant"}
PROMPT = [504, 3458, 282, 4649, 314, 2405, 28, 351, 253, 1789, 282, 5248, 30, 378, 2064, 314, 253, 1345]


@pytest.fixture(scope="module")
def rl_llm(model_dir):
    from margingate.llm import LLM

    return LLM(max_num_seqs=8, weights="bf16")


@pytest.fixture(scope="module")
def server(rl_llm):
    srv = make_server(rl_llm, max_queue=32, default_max_tokens=8)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def original(rl_llm):
    """The loaded weights' folder (bf16 safetensors) and its tensors, by transformers' names."""
    from safetensors.torch import load_file

    folder = rl_llm.weights_folder()
    return folder, load_file(str(folder / "model.safetensors"))


def weights_copy(original, dest, tensors: dict) -> str:
    """A model folder: the loaded one's config and tokenizer, `tensors` as its one safetensors file."""
    from safetensors.torch import save_file

    folder, _ = original
    dest.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dest / f.name)
    save_file(tensors, str(dest / "model.safetensors"))
    return str(dest)


@pytest.fixture(scope="module")
def perturbed(original, tmp_path_factory):
    """The model with its MLPs' down projections nudged (seeded noise, 5 % of their scale): other logprobs."""
    import torch

    gen = torch.Generator().manual_seed(0)
    tensors = {k: (v + 0.05 * v.float().std() * torch.randn(v.shape, generator=gen)).to(v.dtype)
               if k.endswith("down_proj.weight") else v for k, v in original[1].items()}
    return weights_copy(original, tmp_path_factory.mktemp("rl") / "perturbed", tensors)


def complete(http, **body) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "determinism": BI, **body}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def tokens_and_logprobs(answer: dict, i: int = 0) -> tuple[list[int], list[float]]:
    choice = answer["choices"][i]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def alone(llm, ids, max_tokens: int = 8, **sampling) -> tuple[list[int], list[float]]:
    """The request alone, in process, on `llm`'s own engine: tokens and raw logprobs."""
    from margingate.engine import Request
    from margingate.options import SamplingParams

    request = Request(list(ids), max_tokens, llm.policy("batch-invariant"), request_id="alone",
                      sampling=SamplingParams(logprobs=0, **sampling))
    [result] = llm.engine.generate([request])
    return result.token_ids, [lp.logprob for lp in result.logprobs]


def update(http, path, mode: str = "wait"):
    return http.post("/v1/update_weights", json={"path": str(path), "mode": mode})


# --- weights ------------------------------------------------------------------------------------------------

def test_update_from_a_folder_equals_a_fresh_load_bitwise(server, http, perturbed, original):
    from margingate.llm import LLM

    before = complete(http, logprobs=0)
    assert before["determinism"]["weight_version"] == 0 and http.get("/health").json()["weight_version"] == 0
    r = update(http, perturbed)
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == 1 and not r.json()["paused"]  # it paused, swapped and resumed
    try:
        after = complete(http, logprobs=0)
        fresh = LLM(perturbed, max_num_seqs=4, weights="bf16")
        assert tokens_and_logprobs(after) == alone(fresh, PROMPT)  # the first request after the swap, bitwise
        assert tokens_and_logprobs(after)[1] != tokens_and_logprobs(before)[1]
        assert after["determinism"]["weight_version"] == 1 and http.get("/health").json()["weight_version"] == 1
        assert after["system_fingerprint"] != before["system_fingerprint"]
        chat = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "Hi"}]}).json()
        assert chat["determinism"]["weight_version"] == 1
    finally:
        assert update(http, original[0]).json()["weight_version"] == 2
    # the loaded weights back: the answer of version 0, bitwise (the prefix cache was dropped at each swap)
    assert tokens_and_logprobs(complete(http, logprobs=0)) == tokens_and_logprobs(before)


def test_update_in_process_from_a_state_dict(server, http, original):
    import torch

    from margingate.serving_context import WeightsError

    control = server.state.control
    before = complete(http, logprobs=0)
    version = server.engine.weight_version
    # fp32 tensors, as a trainer's master weights: held as bf16, so the same model
    as_fp32 = {k: v.float() for k, v in original[1].items()}
    assert control.update_weights(as_fp32, mode="abort") == version + 1
    assert server.state.worker.paused is None
    assert tokens_and_logprobs(complete(http, logprobs=0)) == tokens_and_logprobs(before)
    name = "model.layers.3.mlp.down_proj.weight"
    missing = {k: v for k, v in original[1].items() if k != name}
    with pytest.raises(WeightsError, match=name):
        control.update_weights(missing)
    misshapen = {**original[1], name: torch.zeros(3, 4, dtype=torch.bfloat16)}
    with pytest.raises(WeightsError, match=rf"{name} .*shape \[3, 4\]"):
        control.update_weights(misshapen)
    assert server.engine.weight_version == version + 1 and server.state.worker.paused is None


def test_bad_weights_get_a_400_naming_the_tensor_and_change_nothing(server, http, original, tmp_path):
    import torch

    before = complete(http, logprobs=0)
    version = server.engine.weight_version
    name = "model.layers.0.self_attn.q_proj.weight"
    few = weights_copy(original, tmp_path / "few", {k: v for k, v in original[1].items() if "layers.0." in k})
    r = update(http, few)  # the first tensor missing is named, and how many more are
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    assert "model.embed_tokens.weight missing" in r.json()["error"]["message"]
    bad = weights_copy(original, tmp_path / "bad", {**original[1], name: torch.zeros(7, 576, dtype=torch.bfloat16)})
    r = update(http, bad)
    assert r.status_code == 400 and name in r.json()["error"]["message"] and "[7, 576]" in r.json()["error"]["message"]
    for body, param in (({"path": str(tmp_path / "nowhere")}, "path"), ({"path": str(bad), "mode": "later"}, "mode"),
                        ({"path": str(bad), "force": True}, "force"), ({}, "path")):
        r = http.post("/v1/update_weights", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert server.engine.weight_version == version and not http.get("/health").json()["paused"]
    assert complete(http, logprobs=0)["choices"] == before["choices"]


# --- an update while a request streams ----------------------------------------------------------------------

def stream_in_thread(server, **body):
    """A streamed completion in a thread; `out` gets its SSE payloads once it ends, `started` is set at the
    first chunk with tokens."""
    import httpx

    out, started = [], threading.Event()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "ignore_eos": True, "determinism": BI,
            "stream": True, "logprobs": 0, **body}

    def run():
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c, c.stream("POST", "/v1/completions",
                                                                              json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    out.append(chunk)
                    if chunk.get("choices") and chunk["choices"][0].get("token_ids"):
                        started.set()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(TIMEOUT)
    return thread, out


def streamed(out) -> tuple[list[int], str | None, dict]:
    ids = [t for c in out for ch in c.get("choices", []) for t in ch.get("token_ids", [])]
    last = [c for c in out if c.get("determinism")][-1]
    return ids, last["choices"][0]["finish_reason"], last["determinism"]


@pytest.fixture(scope="module")
def whole(http):
    """The streamed request's answer, whole and undisturbed."""
    return complete(http, max_tokens=LONG, ignore_eos=True)["choices"][0]["token_ids"]


LONG = 24


@pytest.mark.parametrize("mode", ["abort", pytest.param("wait", marks=pytest.mark.slow), "keep"])
def test_a_pause_during_a_stream_follows_its_mode(server, http, original, whole, mode):
    """/pause, the weights swapped under it (keep: with the request in place), /resume: what the stream gets."""
    version = server.engine.weight_version
    thread, out = stream_in_thread(server, max_tokens=LONG)
    r = http.post("/pause", params={"mode": mode})
    assert r.status_code == 200 and r.json()["mode"] == mode
    if mode == "wait":  # the pause held once the request had finished
        assert http.get("/health").json()["in_flight"] == 0
    arrived = []  # a request sent while paused: held, then served under the weights of the resume
    later = threading.Thread(target=lambda: arrived.append(complete(http)), daemon=True)
    later.start()
    assert poll(lambda: http.get("/health").json()["held"] == 1, 30)
    if mode == "keep":  # an update under the pause keeps it: the trainer resumes
        r = update(http, original[0], "abort")  # the mode of the pause in force holds, not this one
        assert r.status_code == 200 and r.json()["paused"] and r.json()["mode"] == "keep", r.text
    assert http.post("/resume").json()["resumed"] == 1
    thread.join(TIMEOUT)
    later.join(TIMEOUT)
    assert arrived[0]["choices"][0]["token_ids"] == whole[:8]
    assert arrived[0]["determinism"]["weight_version"] == server.engine.weight_version
    assert "weight_versions" not in arrived[0]["determinism"]
    ids, reason, report = streamed(out)
    if mode == "abort":  # a clean end, not an error: the tokens so far are the request's own
        assert reason == "abort" and ids == whole[:len(ids)] and len(ids) < LONG
        assert report["weight_version"] == version
    elif mode == "wait":
        assert reason == "length" and ids == whole and report["weight_version"] == version
    else:  # held, swapped, recomputed: the same weights give the same tokens, and the report says what happened
        assert reason == "length" and ids == whole
        assert report["weight_versions"] == [version, version + 1] and 0 < report["weights_updated_at_token"] < LONG
        assert report["guaranteed"] is False and "weight_versions" in report["warning"]
        assert report["logprobs_guaranteed"] is False
    assert poll(lambda: is_idle(server))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_an_update_during_a_long_stream_pauses_by_itself(server, http, original, mode):
    """No /pause first: the update pauses in its mode (once the weights are read and checked, which takes seconds,
    hence a long stream), swaps and resumes; the stream loses nothing the mode keeps."""
    n = 256
    expected = complete(http, max_tokens=n, ignore_eos=True)["choices"][0]["token_ids"]
    version = server.engine.weight_version
    thread, out = stream_in_thread(server, max_tokens=n)
    r = update(http, original[0], mode)
    assert r.status_code == 200 and not r.json()["paused"], r.text
    thread.join(TIMEOUT)
    ids, reason, report = streamed(out)
    if mode == "abort":
        assert reason == "abort" and ids == expected[:len(ids)] and report["weight_version"] == version
    else:
        assert reason == "length" and ids == expected and report["weight_versions"] == [version, version + 1]
    assert poll(lambda: is_idle(server))


# --- pause, resume, prefix cache ----------------------------------------------------------------------------

def test_pause_holds_new_requests_and_resume_serves_them(server, http):
    expected = complete(http)["choices"][0]["token_ids"]
    assert http.post("/pause", params={"mode": "later"}).status_code == 400
    r = http.post("/pause", params={"mode": "keep"})
    assert r.status_code == 200 and r.json()["paused"] and r.json()["mode"] == "keep"
    try:
        assert http.get("/is_paused").json() == {"is_paused": True}
        answers = []
        held = threading.Thread(target=lambda: answers.append(complete(http)), daemon=True)
        held.start()
        assert poll(lambda: http.get("/health").json()["held"] == 1, 30)
        health = http.get("/health").json()
        assert health["status"] == "ok" and health["paused"] and health["pause_mode"] == "keep"
        assert not answers
    finally:
        r = http.post("/resume")
    assert r.status_code == 200 and r.json()["resumed"] == 1 and not r.json()["paused"]
    held.join(TIMEOUT)
    assert answers[0]["choices"][0]["token_ids"] == expected
    assert http.get("/is_paused").json() == {"is_paused": False}


def test_reset_prefix_cache(http):
    first = complete(http, prompt=PROMPT * 2)
    second = complete(http, prompt=PROMPT * 2)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    r = http.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["blocks_dropped"] > 0
    third = complete(http, prompt=PROMPT * 2)
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"] == third["choices"][0]["token_ids"]


# --- the request surface ------------------------------------------------------------------------------------

def test_return_token_ids_on_completions_and_chat(http, client):
    r = client.completions.with_raw_response.create(model=MODEL, prompt="The sky is", max_tokens=4,
                                                    extra_body={"return_token_ids": True})
    assert "return_token_ids" not in r.headers.get("x-margingate-ignored-fields", "")  # a field we know
    choice = r.parse().choices[0]
    prompt_ids = http.post("/tokenize", json={"prompt": "The sky is"}).json()["tokens"]
    assert choice.model_extra["prompt_token_ids"] == prompt_ids and len(choice.model_extra["token_ids"]) == 4
    assert http.post("/detokenize", json={"tokens": choice.model_extra["token_ids"]}).json()["prompt"] == choice.text
    chunks = sse_events(http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4,
                                                           "stream": True, "return_token_ids": True}))
    assert chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT and chunks[0]["choices"][0]["text"] == ""
    assert [t for c in chunks[1:-1] for t in c["choices"][0]["token_ids"]] == complete(http, max_tokens=4)[
        "choices"][0]["token_ids"]
    messages = [{"role": "user", "content": "Hello"}]
    template_ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3,
                                          extra_body={"return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] == template_ids and len(chat.choices[0].model_extra["token_ids"]) == 3
    chunks = sse_events(http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                                "max_tokens": 3, "stream": True,
                                                                "return_token_ids": True}))
    assert chunks[0]["prompt_token_ids"] == template_ids
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    assert "prompt_token_ids" not in plain.model_extra


def test_ids_outside_the_vocabulary_get_a_400_and_change_nothing(http, rl_llm):
    before = complete(http, logprobs=0)
    vocab = rl_llm.config.vocab_size
    for prompt, param in (([1, 2, vocab], "prompt"), ([-1, 5], "prompt"), ([[1, 2], [3, vocab + 7]], "prompt.1")):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and "outside the vocabulary" in error["message"]
    assert complete(http, logprobs=0)["choices"] == before["choices"]


def test_logprobs_modes_at_temperature_0_7(http, rl_llm):
    """Both modes sample the same tokens; raw reports the model's distribution (what scoring gives), processed
    the tempered one the row drew from: each bitwise the in-process engine's."""
    sampled = {"temperature": 0.7, "seed": 5, "max_tokens": 8, "logprobs": 0}
    raw = tokens_and_logprobs(complete(http, **sampled, logprobs_mode="raw"))
    processed = tokens_and_logprobs(complete(http, **sampled, logprobs_mode="processed"))
    assert raw[0] == processed[0] and raw[1] != processed[1]
    assert raw[1] == rl_llm.score(PROMPT, raw[0]).logprobs
    assert processed == alone(rl_llm, PROMPT, temperature=0.7, seed=5, logprobs_mode="processed")
    assert raw == alone(rl_llm, PROMPT, temperature=0.7, seed=5)


def test_n_samples_are_distinct_and_each_its_seed_alone(http):
    answer = complete(http, n=4, temperature=1.0, seed=11, max_tokens=8)
    samples = [tuple(c["token_ids"]) for c in sorted(answer["choices"], key=lambda c: c["index"])]
    assert len(set(samples)) == 4
    assert tuple(complete(http, temperature=1.0, seed=13, max_tokens=8)["choices"][0]["token_ids"]) == samples[2]
