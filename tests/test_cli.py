"""The command line end to end on the embedded model, on tiny slices."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from margingate.cli import build_parser, main
from margingate.data.prompts import Prompt


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_help_loads_no_torch():
    """Building the parser (`margingate --help`, a typo in a flag) loads no torch, no model code and no
    engine: every command's module keeps them for when it runs. In a fresh interpreter, since this
    one has them loaded already."""
    probe = ("import sys; from margingate.cli import build_parser; build_parser(); "
             "print(sorted(m for m in ('torch', 'margingate.engine.engine', 'margingate.models.decoder', "
             "'margingate.llm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_generate_json(capsys):
    """--json prints one object per prompt with token ids, text and the per-request report."""
    code, out, _ = run(capsys, "generate", "What is 2+2?", "Name a color.", "--policy", "margin",
                       "--max-new-tokens", "6", "--json")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt_index"] for r in rows] == [0, 1]
    for r in rows:
        assert len(r["token_ids"]) <= 6 and isinstance(r["text"], str)
        assert r["stats"]["policy"] == "margin" and "triggers" in r["stats"] and "tau" in r["stats"]


@pytest.mark.slow  # check end to end at two batch sizes (check --policy fast stays)
def test_check_margin_is_deterministic(capsys):
    """check --policy margin on a slice: 100 % sequence determinism, with the documented keys."""
    code, out, _ = run(capsys, "check", "--policy", "margin", "--limit", "3", "--batch-sizes", "1,3",
                       "--max-new-tokens", "12", "--json", "--threads", "2")  # the flag is recorded
    assert code == 0
    report = json.loads(out)
    for key in ("policy", "runs", "sequence_determinism", "flip_rate", "trigger_rate", "repair_rate", "tokens_sha256",
                "per_batch_size"):
        assert key in report
    assert report["sequence_determinism"] == 1.0 and report["flip_rate"] == 0.0
    assert set(report["per_batch_size"]) == {"1", "3"}
    assert report["environment"]["num_threads"] == 2


def test_check_fast_has_no_gate_figures(capsys):
    """fast has no trigger: those rates are null, not zero."""
    code, out, _ = run(capsys, "check", "--policy", "fast", "--limit", "2", "--batch-sizes", "2",
                       "--modes", "hetero", "--max-new-tokens", "4", "--json")
    report = json.loads(out)
    assert code == 0 and report["trigger_rate"] is None and report["repair_rate"] is None


def test_generate_auto_names_its_choice(capsys):
    """--policy auto resolves for --device (CPU: batch-invariant); the report names what it chose."""
    code, out, _ = run(capsys, "generate", "What is 2+2?", "--policy", "auto", "--max-new-tokens", "4", "--json",
                       "--no-prefix-cache")
    stats = json.loads(out.splitlines()[0])["stats"]
    assert code == 0 and stats["policy"] == "batch-invariant" and stats["chosen_by"] == "auto"
    assert build_parser().parse_args(["serve"]).prefix_cache is True
    assert build_parser().parse_args(["serve", "--no-prefix-cache"]).prefix_cache is False


def test_generate_sampled_with_logprobs_then_score_it(capsys, llm, tmp_path):
    """generate's sampling options and --logprobs; `margingate score` of its output gives, bitwise,
    the logprobs generate reported (batch-invariant guarantees them)."""
    argv = ("generate", "Name a fruit.", "--policy", "batch-invariant", "--temperature", "0.9", "--seed", "5",
            "--top-p", "0.8", "--top-k", "30", "--min-p", "0.01", "--presence-penalty", "0.2",
            "--frequency-penalty", "0.1", "--repetition-penalty", "1.05", "--logprobs", "2",
            "--max-new-tokens", "8", "--json", "--no-prefix-cache")
    code, out, _ = run(capsys, *argv)
    row = json.loads(out)
    assert code == 0 and row["seed"] == 5 and len(row["logprobs"]) == len(row["token_ids"])
    assert run(capsys, *argv)[1] == out  # a seeded sample is reproducible
    prompt_ids = llm.tokenizer.encode_prompt(Prompt("chat", ({"role": "user", "content": "Name a fruit."},), None, ""))
    items = tmp_path / "pairs.jsonl"
    items.write_text(json.dumps({"prompt_ids": prompt_ids, "continuation_ids": row["token_ids"]}) + "\n")
    code, out, _ = run(capsys, "score", "--file", str(items), "--top-logprobs", "2")
    scored = json.loads(out)
    assert code == 0 and scored["logprobs"] == [t["logprob"] for t in row["logprobs"]]
    assert scored["top_logprobs"] == [t["top"] for t in row["logprobs"]]
    code, _, err = run(capsys, "score", "--prompt", "Hello")
    assert code == 2 and "go together" in err


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--policy", "nope"], "invalid choice"),
    (["generate", "hi", "--tau", "nan"], "tau must be a number >= 0"),
    (["generate", "hi", "--tau", "-1"], ">= 0"),
    (["generate", "hi", "--tau", "abc"], "number"),
    (["generate", "hi", "--repair", "glue"], "invalid choice"),
    (["check", "--modes", "sideways"], "unknown check mode"),
    (["check", "--batch-sizes", "0,4"], "positive"),
    (["bench", "--policies", "fast,warp"], "unknown bench policy"),
    (["bench", "--quick", "--peers", "sglang"], "unknown peer"),
])
def test_bad_arguments_are_refused(capsys, argv, message):
    """Bad input exits with status 2 and a message naming the problem (argparse or ours)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2 and message in capsys.readouterr().err


def test_missing_prompt_file(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--prompts-file", str(tmp_path / "nope.jsonl"))
    assert code == 2 and "not found" in err


def test_missing_model_folder(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "hi", "--model", str(tmp_path / "no-model"))
    assert code == 2 and "no-model" in err


SMALL_BENCH = ("--limit", "4", "--max-new-tokens", "16", "--batch-sizes", "4", "--repeats", "1", "--warmup", "0",
               "--no-pass-profile")


@pytest.mark.slow  # bench end to end, three policies
def test_bench_small(capsys, tmp_path):
    """bench runs the policies side by side and writes JSON, markdown and a plot."""
    code, out, _ = run(capsys, "bench", *SMALL_BENCH, "--policies", "fast,margin,dvr",
                       "--out", str(tmp_path), "--json")
    assert code == 0
    report = json.loads(out)
    main_ = report["main"]["B4"]
    assert set(main_) == {"fast", "margin", "dvr"}
    assert main_["margin"]["sequence_determinism"] == 1.0 and main_["dvr"]["sequence_determinism"] == 1.0
    assert "increment_ratio_over_margin" in main_["dvr"] or main_["margin"]["overhead"] <= 0
    assert (tmp_path / "report.json").exists() and (tmp_path / "report.md").exists()
    assert list(tmp_path.glob("*.png"))


@pytest.mark.slow  # bench beside transformers' generate
def test_bench_hf_peer_in_the_same_run(capsys, tmp_path):
    """--peers hf runs transformers' generate on the same prompt ids and lengths, in the same table:
    the same 4 x 16 tokens as our policy, each of the 4 outputs judged against HF decoding it alone."""
    code, out, _ = run(capsys, "bench", *SMALL_BENCH, "--policies", "fast", "--peers", "hf",
                       "--out", str(tmp_path), "--json")
    assert code == 0
    table = json.loads(out)["main"]["B4"]
    row, ours = table["hf-generate"], table["fast"]
    for r in (row, ours):
        assert r["tokens_per_s"] * r["seconds_median"] == pytest.approx(4 * 16)
    assert row["protected_requests"] == 4 and row["diverged"] == round(4 * (1 - row["sequence_determinism"]))
    assert row["overhead"] == pytest.approx(row["seconds_median"] / ours["seconds_median"] - 1, rel=1e-6)
    assert "hf-generate" in (tmp_path / "report.md").read_text()


def test_bench_vllm_peer_missing_says_how_to_install(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MARGINGATE_VLLM_PYTHON", str(tmp_path / "no-venv" / "python"))
    code, _, err = run(capsys, "bench", "--quick", "--peers", "vllm")
    assert code == 2 and "make vllm-venv" in err


def test_bench_llamacpp_peer_missing_says_how_to_install(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MARGINGATE_LLAMACPP_PYTHON", str(tmp_path / "no-venv" / "python"))
    code, _, err = run(capsys, "bench", "--quick", "--peers", "hf,llamacpp")
    assert code == 2 and "make llamacpp-venv" in err and "MARGINGATE_LLAMACPP_PYTHON" in err


def test_roofline_table_of_a_prefill_only_run():
    """A bench of one-token requests (a prefill measurement) has no decode step: its floor row says so
    instead of failing to write the report."""
    from margingate.analysis.roofline import format_roofline

    report = {"machine": {"threads": 2, "read_gb_s": 40.0, "gemm_gflop_s": 400.0}, "weight_mb": 269.0,
              "gflop_per_row": 0.27, "floor": {"B1": {"tokens_per_s": 3.5, "decode_step_ms_mean": None}}}
    assert "| 1 | 3.5 | - |" in format_roofline(report)
