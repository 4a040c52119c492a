"""`PolicySpec`: one validation of policy options for the CLI, the server, the bench and the API;
policy facts come from the policy classes."""
from __future__ import annotations

import math

import pytest

from margingate.cli import build_parser
from margingate.cli_args import policy_spec
from margingate.options import PROMISES, REPAIRS, PolicyOptionError, PolicySpec, deterministic_policies
from margingate.policies import POLICIES, build


def test_unknown_policy():
    with pytest.raises(ValueError, match=r"unknown policy 'nope' \(choose from .*margin"):
        PolicySpec("nope")


@pytest.mark.parametrize("tau", [-1, math.nan, "abc", True])
def test_bad_tau(tau):
    """A negative, NaN or non-numeric tau is refused with a message naming tau, whatever the policy."""
    for name in ("margin", "fast"):
        with pytest.raises(PolicyOptionError, match="tau must be a number") as exc:
            PolicySpec(name, tau=tau)
        assert exc.value.option == "tau"


def test_edge_taus_accepted():
    """tau = 0 (exact ties only) and tau = inf (every step) are valid."""
    assert build(PolicySpec("margin", tau=0)).tau == 0.0
    assert build(PolicySpec("margin", tau="inf")).tau == math.inf


@pytest.mark.parametrize("options, option, needle", [
    ({"repair": "bogus"}, "repair", "unknown repair mode 'bogus'"),
    ({"verifier_precision": "fp16"}, "verifier_precision", "unknown verifier precision 'fp16'"),
    ({"defer": -1}, "defer", "defer must be an integer >= 0"),
    ({"defer": 1025}, "defer", "defer must be an integer <= 1024"),
    ({"window": 0}, "window", "dvr window must be an integer >= 1"),
    ({"window": 257}, "window", "dvr window must be an integer <= 256"),
    ({"group": 1.5}, "group", "dvr group must be an integer >= 1"),
    ({"group": 65}, "group", "dvr group must be an integer <= 64"),
    ({"name": "nope"}, "policy", "unknown policy"),
    ({"strict": "yes"}, "strict", "strict must be true or false"),
    ({"inject_flip_at": 3, "name": "fast"}, "inject_flip_at", "needs a verifying policy"),
    # a forced wrong token that nothing would take back: verify-all checks each step as it comes, a column or
    # non-strict margin never looks back
    ({"inject_flip_at": 3, "name": "verify-all"}, "inject_flip_at", "verify-all never would"),
    ({"inject_flip_at": 3, "repair": "column"}, "inject_flip_at", "margin with repair column never would"),
    ({"inject_flip_at": 3, "strict": False}, "inject_flip_at", "repair replay and strict off never would"),
])
def test_bad_options_name_the_option(options, option, needle):
    with pytest.raises(PolicyOptionError, match=needle) as exc:
        PolicySpec(**{"name": "margin", **options})
    assert exc.value.option == option


def test_defaults_and_build():
    """One set of defaults: a spec's build gets them; margin's tau falls back to the model's."""
    margin = build(PolicySpec("margin"), default_tau=0.25)
    assert (margin.tau, margin.repair, margin.strict, margin.defer) == (0.25, "replay", True, 8)
    dvr = build(PolicySpec("dvr", tau=0.1))  # options a policy does not use are ignored
    assert (dvr.window, dvr.group, dvr.pad_to) == (16, 4, 16)
    assert build(PolicySpec("margin", inject_flip_at=2)).inject_flip_at == 2
    assert build(PolicySpec("margin").replace(tau=0.5)).tau == 0.5


def test_promises_are_derived_once_from_the_options():
    """Which policies promise determinism, with which options (a non-strict or column margin does not: a
    flip the gate misses is never taken back), from one place: the spec, its built policy and every option
    combination agree."""
    assert set(deterministic_policies()) == {"reference", "margin", "verify-all", "dvr", "batch-invariant", "auto"}
    assert not PolicySpec("fast").deterministic and not PolicySpec("layercast").deterministic
    assert PolicySpec("margin").deterministic and PolicySpec("verify-all").deterministic
    assert not PolicySpec("margin", strict=False).deterministic
    assert not PolicySpec("margin", repair="column").deterministic
    assert PolicySpec("dvr", strict=False, repair="none").deterministic  # options dvr does not use
    assert PolicySpec("verify-all", strict=False).deterministic
    assert {n for n in POLICIES if PolicySpec(n).promise.verifies} == {"margin", "verify-all", "dvr"}
    assert list(POLICIES) == list(PROMISES)  # every name promises something and builds something
    for name in POLICIES:
        for repair in REPAIRS:
            for strict in (True, False):
                spec = PolicySpec(name, repair=repair, strict=strict)
                policy = build(spec)
                assert policy.promise == spec.promise, spec
                assert policy.guarantees_logprobs == spec.deterministic, spec
    # a non-strict margin never defers: only the strict replay can take back a token decoded after a late flip
    assert build(PolicySpec("margin", strict=False, defer=8)).defer == 0


def test_auto_resolves_per_device(monkeypatch):
    """`auto` is resolved in the spec layer, once: the cheapest guaranteed policy for the device (on a GPU,
    what its bench recorded: here margin; auto_rule's own test in test_triton_engine.py), named in the
    report; other names are left alone, and an unresolved `auto` has no class to build by accident."""
    from margingate.options import auto_rule

    assert PolicySpec("auto").resolve("cuda").name == "batch-invariant"  # no GPU here: never measured
    monkeypatch.setattr(auto_rule, "measured", lambda device: "margin")
    cpu, cuda = PolicySpec("auto").resolve("cpu"), PolicySpec("auto", tau=0.2).resolve("cuda:0")
    assert (cpu.name, cpu.chosen_by) == ("batch-invariant", "auto")
    assert (cuda.name, cuda.tau, cuda.chosen_by) == ("margin", 0.2, "auto")
    assert PolicySpec("dvr").resolve("cuda") == PolicySpec("dvr")
    built = build(PolicySpec("auto"), device="cuda")
    assert built.name == "margin" and built.deterministic and built.chosen_by == "auto"
    assert PolicySpec("auto").deterministic
    assert "auto" not in POLICIES  # nothing to build unless resolved (`build` resolves first)
    with pytest.raises(PolicyOptionError, match="needs a verifying policy"):
        PolicySpec("auto", inject_flip_at=1).resolve("cpu")  # batch-invariant has nothing to inject into
    args = build_parser().parse_args(["generate", "--policy", "auto", "x"])
    assert policy_spec(args).name == "batch-invariant"


def test_cli_accepts_every_tau_the_spec_does(capsys):
    """--tau inf is valid (it verifies every step), as it is for PolicySpec and HTTP; bad ones
    are refused by the parser with the spec's message."""
    parser = build_parser()
    args = parser.parse_args(["generate", "--policy", "margin", "--tau", "inf", "--defer", "0", "x"])
    assert policy_spec(args) == PolicySpec("margin", tau=math.inf, defer=0)
    for bad in ("-1", "nan", "abc"):
        with pytest.raises(SystemExit):
            parser.parse_args(["generate", "--tau", bad])
        assert "tau must be a number" in capsys.readouterr().err


def test_package_exports():
    """`from margingate import LLM, PolicySpec` works; other names still fail loudly."""
    import margingate
    from margingate.llm import LLM
    assert margingate.PolicySpec is PolicySpec and margingate.LLM is LLM
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        margingate.nope  # noqa: B018
