"""`results/gpu/paper_table.py` end to end on the smallest honest shape (one layer, Triton's interpreter on CPU),
as the lent GPU would run it: the test fails if a deterministic policy's digest differs anywhere, if tau was
fitted on a prompt that is then checked or timed, or if the output folder holds a file older than the run.

Sizes: B = 2 only, 3 new tokens against dvr's window of 2 (beyond it, as 256 against 64 on the GPU), one
warm-up and two timed runs: about 30 s of CPU under the interpreter, most of it the 25 runs the
protocol makes (67 s of wall time on 2 cores shared at load average 9).
Also: `scripts/run_status.py`'s statuses, and a SIGTERM that still leaves the report on disk.
"""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Only the child processes run Triton. Importing it here, at collection, would fix its interpreter switch for the
# whole session before the Triton test modules set TRITON_INTERPRET=1, and their kernels would not interpret.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (`pip install triton==3.7.1`)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
TABLE = [sys.executable, str(ROOT / "results/gpu/paper_table.py"), "--device", "cpu", "--shapes", "toy-1"]
SMALL = ["--batch-sizes", "2", "--new", "3", "--cal-new", "3", "--window", "2", "--group", "2", "--check-prompts",
         "2", "--warmup", "1", "--repeats", "2"]
DETERMINISTIC = ("batch-invariant", "margin", "dvr", "verify-all")


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("table") / "out"
    started = time.time()
    done = subprocess.run([*TABLE, *SMALL, "--out", str(out)], env=env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, started, json.loads((out / "paper.json").read_text())


@pytest.mark.slow  # the table's run: about 20 s on 2 cores
def test_every_deterministic_policy_gives_one_digest(table):
    _, _, rep = table
    shape = rep["shapes"]["toy-1"]
    check = shape["check"]["policies"]
    for name in (*DETERMINISTIC, "batch-invariant, no graphs"):
        assert check[name]["sequence_determinism"] == 1.0, name
        assert check[name]["digest"] == shape["check"]["alone"]["digest"], name
    timed = {d for p in DETERMINISTIC for d in shape["bench"]["B2"]["policies"][p]["digests"]}
    assert len(timed) == 1, f"the timed runs of deterministic policies disagree: {timed}"


@pytest.mark.slow
def test_tau_is_fitted_on_prompts_that_are_neither_checked_nor_timed(table):
    _, _, rep = table
    shape = rep["shapes"]["toy-1"]
    fitted = set(shape["tau"]["prompts"])
    assert fitted and fitted <= set(shape["prompt_sets"]["calibration"])
    assert not fitted & set(shape["check"]["prompts"]), "tau was fitted on checked prompts"
    assert not fitted & set(shape["bench"]["B2"]["prompts"]), "tau was fitted on timed prompts"
    assert shape["tau"]["batch_sizes"] == [2] and shape["tau"]["frontier"], "tau was not swept at the table's B"
    assert shape["tau"]["qualified"] and "fallback" not in json.dumps(shape["tau"])


@pytest.mark.slow
def test_the_protocol_times_apart_and_repeats(table):
    _, _, rep = table
    for p, row in rep["shapes"]["toy-1"]["bench"]["B2"]["policies"].items():
        assert len(row["decode_seconds"]) == 2 and all(s > 0 for s in row["prefill_seconds"]), p
        assert row["graphs"] == "stand-in" and row["recorded_shapes"] > 0, p
        assert row["decode_ms_per_step"]["min"] <= row["decode_ms_per_step"]["median"], p


@pytest.mark.slow
def test_every_output_file_is_this_runs(table):
    out, started, rep = table
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(rep["run"]["files"]), files
    assert rep["run"]["started_unix"] >= started
    for p in out.iterdir():
        assert p.stat().st_mtime >= started, f"{p.name} predates the run"


def test_a_fresh_run_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "summary.md").write_text("an old summary\n")
    done = subprocess.run([*TABLE, *SMALL, "--out", str(tmp_path)], env=env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "not empty" in done.stderr


def test_sigterm_saves_the_report_and_exits_124(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([*TABLE, *SMALL, "--out", str(out)], env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not (out / "paper.json").exists() and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 124, log[-2000:]
    assert "signal" in json.loads((out / "paper.json").read_text())["stopped"]["by"]


@pytest.mark.parametrize("rc, status", [(0, "ok"), (3, "partial"), (124, "timeout"), (1, "failed")])
def test_run_status_names_each_ending(tmp_path, rc, status):
    path, tool = tmp_path / "status.json", [sys.executable, str(ROOT / "scripts/run_status.py")]
    subprocess.run([*tool, str(path), "start", "--dry-run", "1", "--total-limit", "540"], check=True)
    subprocess.run([*tool, str(path), "begin", "p8", "--limit", "270"], check=True)
    subprocess.run([*tool, str(path), "part", "p8", "--rc", str(rc), "--seconds", "12.5", "--limit", "270",
                    "--report", str(tmp_path / "none.json")], check=True)
    subprocess.run([*tool, str(path), "end", "--rc", str(int(rc not in (0, 3))), "--seconds", "13"], check=True)
    doc = json.loads(path.read_text())
    assert doc["parts"]["p8"]["status"] == status and doc["parts"]["p8"]["table"] == {"report": "none written"}
    assert doc["failed_parts"] == ([] if rc in (0, 3) else ["p8"])
