"""Recorded forwards (engine/step_graphs.py) on CPU, through their stand-in: padded to buckets of rows, read
from static buffers, the same Python forward. A padding row never changes a real row's bits, so every policy
gives the tokens and logprobs it gives without them; CUDA graphs replay these forwards on a GPU
(test_triton_engine.py captures them there). Also: logits rows left on the device (`DeviceRows`) choose what
host rows choose."""
from __future__ import annotations

import pytest
import torch
from prompt_sets import HET8

from margingate.engine import Request
from margingate.engine.device_rows import DeviceRows, host, margins
from margingate.engine.engine import Engine, EngineConfig
from margingate.engine.sampling import SamplingParams
from margingate.engine.step_graphs import buckets
from margingate.options import PolicySpec
from margingate.policies import build

NEW = 16


@pytest.fixture(scope="module")
def ids(llm, prompts):
    return [llm.tokenizer.encode_prompt(prompts[i]) for i in HET8[:5]]


def run(model, ids, policy: str | PolicySpec, *, on_device: bool = False, **config) -> tuple[list, Engine]:
    """Tokens and logprobs of `ids` (arriving over three steps) and the engine that ran them."""
    spec = policy if isinstance(policy, PolicySpec) else PolicySpec(policy)
    eng = Engine(model, EngineConfig(max_model_len=256, max_num_seqs=8, **config), lambda: build(spec))
    if on_device:
        eng.runner.on_device = True
    reqs = [Request(x, NEW, ignore_eos=True, request_id=f"r{i}", arrival_step=i % 3,
                    sampling=SamplingParams(logprobs=2)) for i, x in enumerate(ids)]
    return [(r.token_ids, [(lp.token, lp.logprob, lp.top) for lp in r.logprobs]) for r in eng.generate(reqs)], eng


def test_buckets_cover_every_row_count():
    sizes = buckets(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 512 and 64 in sizes and 128 in sizes
    assert buckets(5) == [1, 2, 4, 8] and buckets(1) == [1]
    assert all(any(s >= n for s in buckets(100)) for n in range(1, 101))


@pytest.mark.parametrize("policy", ["batch-invariant", "fast", "margin", "dvr"])
def test_padded_buckets_keep_every_bit(llm, ids, policy):
    """Five requests arriving over three steps make batches of 2 to 5 rows, padded to 2, 4 and 8 (and the
    verifier's passes to theirs; dvr's, 8 windows of 64 as LLM-42, pass the requests' 256-position context):
    the tokens and logprobs of the same engine without buckets, bitwise."""
    spec = PolicySpec("dvr", window=64, group=8) if policy == "dvr" else PolicySpec(policy)
    plain, _ = run(llm.model, ids, spec, step_graphs="off")
    padded, eng = run(llm.model, ids, spec, step_graphs="stand-in")
    assert eng.runner.graphs is not None and eng.runner.graphs.recorded >= 3
    assert padded == plain


def test_rows_left_on_the_device_choose_what_host_rows_choose(llm, ids):
    """The runner's device mode (a GPU's) forced on CPU: argmax and margin read back in one copy choose the
    same tokens, and MarginGate triggers at the same steps, as the host rows."""
    plain, _ = run(llm.model, ids, "margin")
    kept, eng = run(llm.model, ids, "margin", on_device=True)
    assert kept == plain
    assert eng.runner.on_device


def test_device_rows_read_back_argmax_and_margin():
    rows = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, -1.0, 0.25, 0.5], [2.0, 1.0, -torch.inf, 0.0]])
    kept = DeviceRows.read(rows)
    assert kept.best == [1, 0, 0]  # ties: the lowest id
    assert margins(kept) == margins(rows) == [0.0, 0.0, 1.0]
    assert torch.equal(host(kept[1:]), rows[1:]) and torch.equal(kept[2], rows[2])
    assert len(kept[:2]) == 2 and kept[:2].best == [1, 0]


def test_step_graphs_refuse_an_unknown_mode():
    with pytest.raises(ValueError, match="step_graphs"):
        EngineConfig(step_graphs="sometimes")


def test_capture_needs_a_gpu(llm):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: test_triton_engine.py captures on it")
    with pytest.raises(ValueError, match="CUDA graphs"):
        Engine(llm.model, EngineConfig(max_model_len=256, step_graphs="cuda"), lambda: build(PolicySpec("fast")))
