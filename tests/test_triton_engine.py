"""The engine's CUDA code path (the Triton kernels, `--kernels triton`) end to end, on a small
random-weight Llama: the model against transformers, and the determinism contract through the
engine (each deterministic policy in a heterogeneous batch = the request alone under `reference`).

Without a CUDA device the Triton kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1,
set here before triton is imported), so the model is tiny: 2 layers, a 256-token vocabulary.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed (`pip install triton==3.7.1`)")

from kv_helpers import request_pool  # noqa: E402

from margingate.engine import Request  # noqa: E402
from margingate.engine.engine import Engine, EngineConfig  # noqa: E402
from margingate.engine.sampling import SamplingParams  # noqa: E402
from margingate.kernels import triton as mt  # noqa: E402
from margingate.models.decoder import AttentionPlan, DecoderModel, resolve_kernels  # noqa: E402
from margingate.models.loader import load_config, load_state_dict, resolve_model_dir  # noqa: E402
from margingate.options import PolicySpec, SpeculativeConfig  # noqa: E402
from margingate.policies import build  # noqa: E402

DEVICE = "cpu" if mt.interpreting() else "cuda"
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
# prompts of different lengths, some repeating themselves (so that prompt lookup has matches)
PROMPTS = [[5, 9, 17, 33, 5, 9, 17], [200, 3, 3, 71, 100, 42, 8, 8, 19, 27, 64], [7, 7, 7, 7]]
NEW = 6


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE)).float().eval()
    with torch.no_grad():
        for p in model.parameters():  # bf16-representable, as the engine holds weights
            p.copy_(p.to(torch.bfloat16).float() * 4)  # larger weights: logits far from uniform
    folder = tmp_path_factory.mktemp("triton-llama")
    model.save_pretrained(folder)
    return model, resolve_model_dir(str(folder))


@pytest.fixture(scope="module")
def model(hf_folder):
    folder = hf_folder[1]
    return DecoderModel(load_config(folder), load_state_dict(folder), DEVICE, kernels="triton")


def test_triton_kernels_are_resolved_by_device():
    assert resolve_kernels("auto", torch.device("cpu")) == "compiled"
    assert resolve_kernels("triton", torch.device("cpu")) == "triton"
    with pytest.raises(ValueError, match="unknown kernels 'cublas'"):
        resolve_kernels("cublas", torch.device("cpu"))


def test_triton_model_matches_transformers(hf_folder, model):
    """fp32 activations over the bf16 weights through the Triton kernels: a prompt and one decode row
    (exact attention) match transformers' fp32 logits."""
    hf = hf_folder[0]
    cfg = model.config
    tokens = torch.tensor(PROMPTS[1])
    n = len(tokens)
    kv, tables = request_pool(cfg, 2, 32, torch.float32, device=DEVICE)
    logits = model.forward(tokens.to(DEVICE), torch.arange(n, device=DEVICE), tables,
                           torch.zeros(n, dtype=torch.long, device=DEVICE), AttentionPlan.all_exact(n), kv,
                           dtype=torch.float32)
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0].float()
    assert (logits.cpu() - expected).abs().max() < 1e-3


def engine(model, policy: str, batch: int = 4) -> Engine:
    return Engine(model, EngineConfig(max_num_seqs=batch, max_model_len=64), lambda: build(PolicySpec(policy)))


def decode(eng: Engine, prompts, policy: str, tag: str, **kw) -> list[list[int]]:
    reqs = [Request(p, NEW, build(PolicySpec(policy)), ignore_eos=True, request_id=f"{tag}{i}", **kw)
            for i, p in enumerate(prompts)]
    return [r.token_ids for r in eng.generate(reqs)]


@pytest.fixture(scope="module")
def alone(model):
    """Each prompt decoded alone under `reference` on the Triton path: what every policy must give."""
    eng = engine(model, "reference", batch=1)
    return [decode(eng, [p], "reference", "a")[0] for p in PROMPTS]


@pytest.mark.parametrize("policy", ["batch-invariant", "margin", "dvr"])
def test_triton_engine_keeps_the_contract(model, alone, policy):
    """The check, end to end on the CUDA code path: the prompts together in one batch (with a `fast`
    request sharing the steps) give each request's tokens alone."""
    eng = engine(model, policy)
    reqs = [Request(p, NEW, build(PolicySpec(policy)), ignore_eos=True, request_id=f"b{i}")
            for i, p in enumerate(PROMPTS)]
    reqs.append(Request(PROMPTS[0][:3], NEW, build(PolicySpec("fast")), ignore_eos=True, request_id="fast"))
    out = [r.token_ids for r in eng.generate(reqs)]
    assert out[:3] == alone


RECORDED = "cuda" if DEVICE == "cuda" else "stand-in"  # CUDA graphs on a GPU, their stand-in under the interpreter


def recorded_run(model, policy: str, graphs: str) -> list:
    eng = Engine(model, EngineConfig(max_num_seqs=4, max_model_len=64, step_graphs=graphs),
                 lambda: build(PolicySpec(policy)))
    reqs = [Request(p, NEW, ignore_eos=True, request_id=f"g{i}", arrival_step=i, sampling=SamplingParams(logprobs=2))
            for i, p in enumerate(PROMPTS)]
    out = [(r.token_ids, [(lp.token, lp.logprob, lp.top) for lp in r.logprobs]) for r in eng.generate(reqs)]
    assert graphs == "off" or eng.runner.graphs.recorded >= 2
    return out


# batch-invariant in the default tier; the verifiers' passes (slow under the interpreter) in the slow one, and
# every policy on the compiled CPU kernels in test_step_graphs.py
@pytest.mark.parametrize("policy", ["batch-invariant", pytest.param("margin", marks=pytest.mark.slow),
                                    pytest.param("dvr", marks=pytest.mark.slow), "fast"])
def test_triton_recorded_forwards_keep_every_bit(model, policy):
    """Forwards padded to buckets of rows and recorded (CUDA graphs on a GPU, their stand-in under the
    interpreter): the tokens and logprobs of the same engine without them, bitwise. `fast`'s cuBLAS picks its
    kernel by the padded shape, so on a GPU its graphs are held to the stand-in, which pads the same."""
    if policy == "fast" and RECORDED != "cuda":
        pytest.skip("fast's recorded forwards are checked against their stand-in on a GPU (here both are the "
                    "stand-in)")
    base = "stand-in" if policy == "fast" else "off"
    assert recorded_run(model, policy, RECORDED) == recorded_run(model, policy, base)


def test_triton_speculation_equals_plain(model, alone):
    """Prompt lookup on the Triton path: the [last, d1..dk] span through the same kernels, same tokens."""
    eng = engine(model, "batch-invariant")
    spec = SpeculativeConfig("ngram", num_tokens=3)
    assert decode(eng, PROMPTS, "batch-invariant", "s", speculative=spec) == alone


def test_triton_auto_on_cuda_follows_the_recorded_bench(tmp_path, monkeypatch):
    """`auto` on a GPU: batch-invariant until a bench on it recorded which guarantee costs less."""
    from margingate.options import auto_rule
    from margingate.options.policy import auto_policy

    monkeypatch.setenv("MARGINGATE_CACHE", str(tmp_path))
    monkeypatch.setattr(auto_rule, "gpu_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert auto_policy("cuda") == "batch-invariant" and auto_policy("cpu") == "batch-invariant"

    def main(bi: float, margin: float) -> dict:  # tokens/s at one batch size, fast at 100
        return {"fast": {"tokens_per_s": 100.0}, "batch-invariant": {"tokens_per_s": bi},
                "margin": {"tokens_per_s": margin}}

    report = {"main": {"B1": main(80, 90), "B8": main(70, 85), "B64": main(75, 60)}}
    path = auto_rule.record(report, "cuda")
    assert path.name == "NVIDIA_H100_80GB_HBM3.json" and auto_policy("cuda") == "margin"  # margin cheaper at 2 of 3
    auto_rule.record({"main": {"B8": main(90, 80)}}, "cuda")
    assert auto_policy("cuda") == "batch-invariant"
    assert auto_rule.record({"main": {"B8": {"fast": {"tokens_per_s": 1.0}}}}, "cuda") is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the rotary tables live on the CPU "
                    "and must follow the positions to theirs (the first H200 run failed here)")
def test_rotary_tables_follow_the_positions_device():
    from margingate.kernels.rotary import RotaryTable

    table = RotaryTable(64, 10000.0)
    on_cpu = table.lookup(torch.tensor([0, 5, 300]), torch.bfloat16)
    on_gpu = table.lookup(torch.tensor([0, 5, 300], device="cuda"), torch.bfloat16)
    assert all(t.device.type == "cuda" for t in on_gpu)
    assert all(torch.equal(a, b.cpu()) for a, b in zip(on_cpu, on_gpu))


@pytest.mark.slow  # the interpreter's forward and backward: the default tier holds the compiled path to the engine
def test_trainable_model_on_triton_is_the_triton_engine_bitwise(hf_folder, model):
    """The trainable model over the Triton kernels: three prompts in one right-padded batch give each prompt's
    logits as the Triton engine computes it alone, bitwise, and the backward reaches every parameter."""
    from margingate.train import TrainableModel, token_logprobs
    from margingate.train.rollouts import padded

    folder = hf_folder[1]
    trainer = TrainableModel(load_config(folder), load_state_dict(folder), kernels="triton").to(DEVICE)
    ids, mask = padded(PROMPTS)
    out = trainer(ids.to(DEVICE), attention_mask=mask.to(DEVICE)).logits
    for b, p in enumerate(PROMPTS):
        n = len(p)
        kv, tables = request_pool(model.config, 1, n, torch.bfloat16, device=DEVICE)
        alone = model.forward(torch.tensor(p, device=DEVICE), torch.arange(n, device=DEVICE), tables,
                              torch.zeros(n, dtype=torch.long, device=DEVICE), AttentionPlan.all_exact(n), kv)
        assert torch.equal(out[b, :n], alone), f"prompt {b}"
    keep = (mask[:, 1:] * mask[:, :-1]).bool().to(DEVICE)
    token_logprobs(out[:, :-1], ids[:, 1:].to(DEVICE))[keep].sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in trainer.parameters())
