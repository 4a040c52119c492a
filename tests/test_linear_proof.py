"""Each linear path is proven at load (csrc/linear_proof.cpp), and a path that fails is refused.

Every path computes the contract's order (csrc/contract.h, 1); a path that no one could run here
(AMX on this machine, say) must still never change a bit silently. So before a path serves its first
call in a process it computes a fixed set of small products and must equal the scalar reference bit
for bit. These tests make a path fail (MARGINGATE_PROOF_FAULT flips one output bit inside its proof)
and check what a user sees: a warning naming it, the next path in use with the same tokens, the
refusal in the report, `selftest`'s exit status, and an error when the refused path is forced.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from margingate.commands import selftest
from margingate.data.prompts import builtin_prompts
from margingate.kernels import invariant as K
from margingate.kernels import isa_units


def test_every_path_this_cpu_runs_passes_its_proof():
    """Each path this CPU has and the compiler built is proven and passes; the others say why not."""
    proofs = {p["path"]: p for p in K.proofs("bf16")}
    assert list(proofs) == list(K.PATHS["bf16"])
    for path, p in proofs.items():
        if path in K.usable_paths("bf16"):
            assert p["status"] == "passed" and p["detail"] == "", p
        else:
            assert p["status"] in ("cpu lacks it", "not built"), p
    assert K.path_in_use("bf16") == K.usable_paths("bf16")[0] and K.refused_paths("bf16") == {}


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})


def test_one_table_holds_both_families_and_python_mirrors_it():
    """csrc/linear_paths.cpp's one table: the bf16 and the int8 paths, each family fastest first, in the order
    of PATHS (what must name them before the kernels are built), each with one of the report's statuses."""
    rows = K.ops().path_proofs()
    assert [(f, p) for f, p, _, _ in rows] == [(f, p) for f, names in K.PATHS.items() for p in names]
    assert {st for _, _, st, _ in rows} <= {"passed", "failed", "not built", "cpu lacks it"}


def test_a_failed_proof_reads_failed_in_the_one_report():
    """One bit flipped in the proof of a bf16 path and of an int8 path (a fresh process): the one report says
    "failed" for both, with the first difference, each is refused with a warning, and forcing it is an error."""
    bf16, int8 = K.usable_paths("bf16")[-1], K.usable_paths("int8")[-1]
    code = ("import json; from margingate.kernels import invariant as K; print(json.dumps(K.ops().path_proofs()))\n"
            f"try:\n    K.use_path({int8!r})\nexcept K.IsaError as e:\n    print(e)")
    done = _run(code, MARGINGATE_PROOF_FAULT=f"{bf16},{int8}")
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    rows = {p: (st, d) for _, p, st, d in json.loads(out[0])}
    assert rows[bf16][0] == "failed" and "outputs differ" in rows[bf16][1], rows[bf16]
    assert rows[int8][0] == "failed" and rows[int8][1].startswith("int8, "), rows[int8]
    assert [p for p, (st, _) in rows.items() if st == "failed"] == [bf16, int8]
    assert f"the linear path '{bf16}' was refused" in done.stderr
    assert f"the int8 linear path '{int8}' was refused" in done.stderr
    assert f"the int8 linear path '{int8}' was refused at load: its proof failed (int8, " in out[1]


REPORT = """
import json
from margingate.llm import LLM
from margingate.data.prompts import builtin_prompts
llm = LLM(max_num_seqs=2)
out = llm.generate([builtin_prompts()[0], builtin_prompts()[20]], max_new_tokens=24, policy=llm.policy("reference"))
env = llm.environment()
print(json.dumps({"path": env["kernels_linear_path"], "refused": env["kernels_linear_refused"],
                  "tokens": [c.token_ids for c in out]}))
"""


def test_a_path_that_fails_its_proof_is_refused_named_and_skipped(llm):
    """The fastest path fails its proof: a warning names it, the next path runs the same tokens,
    and the environment record (every report, /health) names the refusal and why."""
    fastest, *rest = K.usable_paths("bf16")
    if not rest:
        pytest.skip("this CPU runs one linear path only: none to fall back to")
    done = _run(REPORT, MARGINGATE_PROOF_FAULT=fastest)
    assert done.returncode == 0, done.stderr
    assert f"the linear path '{fastest}' was refused" in done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["path"] == rest[0] and list(got["refused"]) == [fastest]
    assert "outputs differ" in got["refused"][fastest]
    prompts = [builtin_prompts()[0], builtin_prompts()[20]]
    here = llm.generate(prompts, max_new_tokens=24, policy=llm.policy("reference"))
    assert K.path_in_use("bf16") == fastest
    assert got["tokens"] == [c.token_ids for c in here]  # the next path: the same order, the same tokens


def test_forcing_a_refused_path_is_an_error_that_says_why():
    done = _run("from margingate.kernels import invariant as K; K.ops()", MARGINGATE_PROOF_FAULT="avx2",
                MARGINGATE_FORCE_ISA="avx2")
    assert done.returncode != 0
    assert "the linear path 'avx2' was refused at load" in done.stderr and "outputs differ" in done.stderr


@pytest.mark.slow  # selftest in a fresh process
def test_selftest_names_each_path_and_fails_on_a_refusal(llm, request):
    """`margingate selftest`: the CPU, each path's proof and the one in use, the reference digest (the
    one this process computes); exit status 1 when a path this CPU has was refused."""
    cli = [sys.executable, "-m", "margingate.cli", "selftest", "--json"]
    if len(K.usable_paths("bf16")) > 1:  # refuse the avx2 path: another bf16 path runs the int8 model's digest
        fault, digest = "avx2", selftest.reference_digest(llm)["digest"]
    else:  # avx2 is this CPU's only bf16 path: refuse the int8 path, and the digest is exact's
        fault, cli = "int8-avx2", [*cli, "--weights", "exact"]
        digest = selftest.reference_digest(request.getfixturevalue("exact_llm"))["digest"]
    bad = subprocess.run(cli, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "MARGINGATE_PROOF_FAULT": fault})
    assert bad.returncode == 1, bad.stderr
    report = json.loads(bad.stdout)
    statuses = {p["path"]: p["status"] for p in [*report["linear"]["paths"], *report["linear"]["int8"]]}
    assert statuses[fault] == "failed" and list(statuses.values()).count("failed") == 1
    assert report["linear"]["in_use"] == K.path_in_use("bf16")
    assert report["reference"]["digest"] == digest


@pytest.mark.slow  # compiles every ISA unit with a stand-in compiler: about 40 s on 2 cores
def test_a_unit_the_compiler_cannot_build_is_left_out(tmp_path):
    """A compiler without a target (GCC < 11 has no AMX intrinsics) leaves that unit out and reports
    the path "not built"; the other units and the dispatcher still compile (no MG_BUILT_* macros)."""
    cxx = tmp_path / "cxx"  # a compiler that cannot build the AMX units (bf16 and int8)
    cxx.write_text('#!/bin/sh\nfor a in "$@"; do case "$a" in *_amx.cpp) exit 1;; esac; done\nexec c++ "$@"\n')
    cxx.chmod(0o755)
    csrc = Path(K.__file__).parent / "csrc"
    built = isa_units.buildable(csrc, ["-mavx2", "-mfma"], tmp_path / "units.json", str(cxx))
    assert built == {"amx": False, "avx512bf16": True, "avx512": True, "int8-amx": False, "int8-avx512vnni": True}
    sources, defines = isa_units.sources_and_defines(csrc, built)
    assert not any(s.endswith("_amx.cpp") for s in sources)
    assert "-DMG_BUILT_AMX=1" not in defines and "-DMG_BUILT_INT8_AMX=1" not in defines
    import sysconfig

    from torch.utils.cpp_extension import include_paths
    flags = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"], csrc]]
    flags += ["-std=c++17", "-mavx2", "-mfma", "-fsyntax-only"]
    for dispatcher in ("linear_paths.cpp", "linear_int8.cpp"):
        done = subprocess.run(["c++", *flags, str(csrc / dispatcher)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
