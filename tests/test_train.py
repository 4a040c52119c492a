"""Rollout = trainer: the trainable model's logprobs are the engine's bitwise, its gradients are right, and
the trainer's weights go back into the running engine.

On the embedded model (bf16 weights, as an RL loop trains them): rollouts sampled under each deterministic
policy beside other traffic, rescored by `TrainableModel` in padded batches of another size and order, agree
on every sampled token; `fast` rollouts and transformers' forward as the trainer are the inverse controls and
must not. Every op's backward is checked by gradcheck in fp64 and its forward against the plain math the
backward differentiates. The architectures one by one: tests/test_each_architecture.py.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from margingate.engine import Request
from margingate.models.weights import WeightsError
from margingate.options import SamplingParams
from margingate.train import TrainableModel, token_logprobs
from margingate.train import autograd as A
from margingate.train.rollouts import compare, rescored, sample

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=1.0, seed=11)
FILTERED = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=5, logprobs_mode="processed")
SAMPLINGS = {"greedy": GREEDY, "seeded": SEEDED, "processed": FILTERED}
# the default tier's pairs; the slow tier runs every pair
CORE = {("batch-invariant", "greedy"), ("batch-invariant", "processed"), ("margin", "seeded"), ("dvr", "greedy")}


@pytest.fixture(scope="module")
def bf16_llm(model_dir):
    from margingate.llm import LLM

    return LLM(weights="bf16", max_num_seqs=16)


@pytest.fixture(scope="module")
def trainer(model_dir):
    return TrainableModel.from_pretrained("smollm2-135m")


@pytest.fixture(scope="module")
def prompt_ids(bf16_llm, prompts):
    """Ten prompts cut to at most 48 tokens: mixed lengths, and short enough for the default tier."""
    return [bf16_llm.tokenizer.encode_prompt(p)[:48 - 3 * i] for i, p in enumerate(prompts[:10])]


def _traffic(llm, prompt_ids) -> list[Request]:
    """Unprotected requests sharing the rollouts' batches."""
    return [Request(p, 12, llm.policy("fast"), request_id=f"traffic-{i}") for i, p in enumerate(prompt_ids)]


def _forward(model):
    return lambda ids, mask: model(ids, attention_mask=mask).logits


@pytest.mark.parametrize("policy,sampling", [
    (p, s) if (p, s) in CORE else pytest.param(p, s, marks=pytest.mark.slow)
    for p in ("batch-invariant", "reference", "margin", "dvr") for s in SAMPLINGS])
def test_rollout_logprobs_equal_the_trainers_bitwise(bf16_llm, trainer, prompt_ids, policy, sampling):
    """6 rollouts (12 tokens) beside 4 unprotected requests; rescored at trainer batches of 6 (right padding) and
    4 + 2 in another order (left padding): every sampled token's logprob equal, bitwise."""
    rollouts = sample(bf16_llm.engine, prompt_ids[:6], SAMPLINGS[sampling], bf16_llm.policy(policy),
                      max_new_tokens=12, traffic=_traffic(bf16_llm, prompt_ids[6:]))
    with torch.no_grad():
        whole = compare(rollouts, rescored(_forward(trainer), rollouts))
        order = [5, 2, 0, 3, 1, 4]
        parts = [rescored(_forward(trainer), [rollouts[i] for i in chunk], side="left")
                 for chunk in (order[:4], order[4:])]
        reordered = compare([rollouts[i] for i in order], [t for part in parts for t in part])
    assert whole.tokens == sum(len(r.token_ids) for r in rollouts) > 40
    assert whole.differing == 0 and reordered.differing == 0, (whole, reordered)


def test_fast_rollouts_are_not_the_trainers(bf16_llm, trainer, prompt_ids):
    """The inverse control: `fast` decode rows attend as one padded batch, so their logprobs are not the
    trainer's (whose rows are each the request alone)."""
    rollouts = sample(bf16_llm.engine, prompt_ids[:8], GREEDY, bf16_llm.policy("fast"), max_new_tokens=12)
    with torch.no_grad():
        found = compare(rollouts, rescored(_forward(trainer), rollouts))
    assert found.differing > 0, found


@pytest.mark.slow
def test_transformers_as_the_trainer_is_not_the_rollout(bf16_llm, prompt_ids, model_dir):
    """The other inverse control: transformers' own bf16 forward rescoring batch-invariant rollouts."""
    tf = pytest.importorskip("transformers")
    hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    rollouts = sample(bf16_llm.engine, prompt_ids[:4], GREEDY, bf16_llm.policy("batch-invariant"), max_new_tokens=16)
    with torch.no_grad():
        found = compare(rollouts, rescored(lambda ids, mask: hf(ids, attention_mask=mask).logits.float(), rollouts))
    assert found.differing > 0 and found.max_abs > 1e-3, found


# --- gradients ------------------------------------------------------------------------------------------------

def _fp64(*shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).requires_grad_()


@pytest.mark.parametrize("op", ["linear", "rmsnorm", "rmsnorm-unit", "silu", "gelu", "attention", "window",
                                "route", "logprobs"])
def test_each_ops_backward_passes_gradcheck_in_fp64(op):
    """The backward of every op is the gradient of its plain math (fp64 inputs run that math forward too)."""
    cases = {
        "linear": lambda: (lambda x, w, b: A.TRAIN.linear(x, A.Param(w, None), b), (_fp64(3, 5), _fp64(4, 5, seed=1),
                                                                           _fp64(4, seed=2))),
        "rmsnorm": lambda: (lambda x, w: A.TRAIN.rmsnorm(x, w, 1e-5), (_fp64(3, 2, 6), _fp64(6, seed=1))),
        "rmsnorm-unit": lambda: (lambda x, w: A.TRAIN.rmsnorm(x, w, 1e-6, True), (_fp64(3, 6), _fp64(6, seed=1))),
        "silu": lambda: (A.TRAIN.silu_mul, (_fp64(3, 8),)),
        "gelu": lambda: (A.TRAIN.gelu_tanh_mul, (_fp64(3, 8),)),
        "attention": lambda: (lambda q, k, v: A.attention(q, k, v, A.AttentionSite(None, None, [0, 3, 5], 0.5)),
                              (_fp64(5, 4, 3), _fp64(5, 2, 3, seed=1), _fp64(5, 2, 3, seed=2))),
        "window": lambda: (lambda q, k, v: A.attention(q, k, v, A.AttentionSite(None, None, [0, 6], 0.5, window=2)),
                           (_fp64(6, 2, 3), _fp64(6, 1, 3, seed=1), _fp64(6, 1, 3, seed=2))),
        "route": lambda: (lambda x: A.route(x, 2, True)[1], (_fp64(4, 6),)),
        "logprobs": lambda: (lambda x: token_logprobs(x.float(), torch.tensor([1, 4, 0])).double(), (_fp64(3, 7),)),
    }
    fn, inputs = cases[op]()
    if op in ("route", "logprobs"):  # their forwards are the kernels' (fp32): check the backward against fp32 steps
        assert torch.autograd.gradcheck(fn, inputs, eps=1e-3, atol=2e-3, rtol=2e-3)
    else:
        assert torch.autograd.gradcheck(fn, inputs)


def test_attention_backward_keeps_its_own_layers_window():
    """The model moves one site from layer to layer (its window changes with the layer): a backward must use
    the window its forward ran with."""
    q, k, v = _fp64(6, 2, 3), _fp64(6, 1, 3, seed=1), _fp64(6, 1, 3, seed=2)
    site = A.AttentionSite(None, None, [0, 6], 0.5, window=2)
    out = A.attention(q, k, v, site)
    site.window = 0  # the next layer's
    got = torch.autograd.grad(out.sum(), (q, k, v))
    want = torch.autograd.grad(A.attention_ref(q, k, v, [0, 6], 0.5, 2).sum(), (q, k, v))
    assert all(torch.allclose(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("op", ["linear", "rmsnorm", "silu", "gelu", "attention"])
def test_each_ops_kernel_computes_the_math_its_backward_differentiates(op):
    """A backward is only right for the forward it pairs with: each kernel's bf16 result is the plain math's
    within bf16 rounding."""
    g = torch.Generator().manual_seed(4)

    def bf16(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    x, w, b = bf16(7, 64), bf16(48, 64), bf16(48)
    q, k, v = bf16(9, 4, 64), bf16(9, 2, 64), bf16(9, 2, 64)
    if op == "attention":
        site = _site([4, 5], 2, 64)
        got, want = A.attention(q, k, v, site), A.attention_ref(q.float(), k.float(), v.float(), [0, 4, 9], 0.125, 0)
    else:
        got, want = {
            "linear": (A.TRAIN.linear(x, A.Param.of(w), b), A.linear_ref(x.float(), w.float(), b.float())),
            "rmsnorm": (A.TRAIN.rmsnorm(x, x[0], 1e-5), A.rmsnorm_ref(x.float(), x[0].float(), 1e-5, False)),
            "silu": (A.TRAIN.silu_mul(x), A.silu_mul_ref(x.float())),
            "gelu": (A.TRAIN.gelu_tanh_mul(x), A.gelu_tanh_mul_ref(x.float())),
        }[op]
    scale = want.abs().max()
    assert (got.float() - want).abs().max() <= 2 ** -7 * scale, op


def _site(lengths: list[int], kv_heads: int, head_dim: int) -> A.AttentionSite:
    """The trainable model's attention site for sequences of these lengths (scale 1/sqrt(64))."""
    from margingate.kernels.attention import AttentionPlan, AttentionRows
    from margingate.models.kv_cache import KVPool

    pool = KVPool(1, 1 + len(lengths), 16, kv_heads, head_dim)
    tables = torch.tensor([[pool.allocate()] for _ in lengths])
    positions = torch.cat([torch.arange(n) for n in lengths])
    table_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    return A.AttentionSite(AttentionRows(AttentionPlan.all_exact(len(positions)), tables, table_of, positions),
                           pool, starts, 0.125)


def test_padding_refuses_a_row_with_a_gap(trainer):
    with pytest.raises(ValueError, match="row 1 of attention_mask has a gap"):
        trainer(torch.ones(2, 4, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]]))


# --- weights into the running engine --------------------------------------------------------------------------

@pytest.fixture
def updated_llm(bf16_llm, trainer):
    """The module's engine, its load-time weights put back after each test that changes them."""
    yield bf16_llm
    bf16_llm.update_weights(trainer.state_dict())


def test_after_a_training_step_the_engine_reports_the_trainers_logprobs(updated_llm, prompt_ids):
    """One optimizer step on fp32 master weights, `update_weights(state_dict())`, then rollouts: the new
    weights' logprobs, equal to the trainer's bitwise, the weight version in every report."""
    model = TrainableModel.from_pretrained("smollm2-135m", param_dtype=torch.float32)
    policy = updated_llm.policy("batch-invariant")
    before = sample(updated_llm.engine, prompt_ids[:3], SEEDED, policy, max_new_tokens=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss = -torch.cat(rescored(_forward(model), before)).sum()
    loss.backward()
    opt.step()
    version = updated_llm.update_weights(model.state_dict())
    after = sample(updated_llm.engine, prompt_ids[:3], SEEDED, policy, max_new_tokens=8)
    with torch.no_grad():
        found = compare(after, rescored(_forward(model), after))
    assert found.differing == 0, found
    assert [r.logprobs for r in after] != [r.logprobs for r in before]  # the weights did change
    result = updated_llm.generate("Hi", max_new_tokens=1)[0]
    assert result.stats["weight_version"] == version == updated_llm.engine.weight_version >= 1


def test_update_from_a_folder_equals_a_fresh_engine_on_that_folder(updated_llm, model_dir, tmp_path):
    from margingate.llm import LLM
    from margingate.models.loader import load_state_dict

    folder = tmp_path / "perturbed"
    folder.mkdir()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (folder / f.name).write_bytes(f.read_bytes())
    state = {k: v.clone() for k, v in load_state_dict(model_dir).items()}
    state["model.norm.weight"] = (state["model.norm.weight"].float() * 1.01).to(torch.bfloat16)
    save_file(state, folder / "model.safetensors")
    updated_llm.update_weights(str(folder))
    fresh_llm = LLM(str(folder), weights="bf16", max_num_seqs=8)
    ours, fresh = ([llm.generate(["Name a fruit.", "Count to five."], max_new_tokens=12, policy=llm.policy("reference"),
                                 sampling=SamplingParams(logprobs=0))] for llm in (updated_llm, fresh_llm))
    assert [(o.token_ids, o.logprobs) for o in ours[0]] == [(f.token_ids, f.logprobs) for f in fresh[0]]


def test_a_bad_update_is_refused_by_name_and_changes_nothing(updated_llm, trainer, tmp_path):
    state = trainer.state_dict()
    version = updated_llm.engine.weight_version
    first = updated_llm.generate("Hi there", max_new_tokens=6, sampling=SamplingParams(logprobs=0))[0]
    missing = {k: v for k, v in state.items() if k != "model.layers.3.mlp.up_proj.weight"}
    with pytest.raises(WeightsError, match="model.layers.3.mlp.up_proj.weight missing"):
        updated_llm.update_weights(missing)
    with pytest.raises(WeightsError, match=r"model.norm.weight .* has shape \[3\]"):
        updated_llm.update_weights({**state, "model.norm.weight": torch.ones(3)})
    with pytest.raises(WeightsError, match="not a folder of safetensors"):
        updated_llm.update_weights(str(tmp_path))
    updated_llm.engine.add_request(Request([1, 2, 3], 2, request_id="in-flight"))
    with pytest.raises(RuntimeError, match="cannot update weights with 0 running and 1 waiting"):
        updated_llm.update_weights(state)
    while updated_llm.engine.has_work:  # the request in flight finishes untouched
        updated_llm.engine.step()
    again = updated_llm.generate("Hi there", max_new_tokens=6, sampling=SamplingParams(logprobs=0))[0]
    assert updated_llm.engine.weight_version == version
    assert (again.token_ids, again.logprobs) == (first.token_ids, first.logprobs)
