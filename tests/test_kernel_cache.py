"""The compiled kernels' cache: keyed by what the build depends on (not by where the checkout lies), and a
lock left by a killed build cleared rather than waited on. These call the key and lock functions directly:
nothing here builds the extension."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from margingate.errors import KernelBuildError
from margingate.kernels import build_lock, extension

CSRC = Path(extension.__file__).parent / "csrc"
FLAGS, LDFLAGS, COMPILER, TORCH = ["-O3", "-mavx2"], ["-fopenmp"], "c++ (GCC) 12.2.0", "2.13.0+cpu"


def _key(csrc: Path, flags=FLAGS, compiler=COMPILER, torch_version=TORCH) -> str:
    return extension.build_key(csrc, flags, LDFLAGS, compiler, torch_version)


@pytest.fixture
def two_checkouts(tmp_path):
    """The kernel sources copied into two folders at different paths (two checkouts of the same code)."""
    a, b = tmp_path / "clone" / "csrc", tmp_path / "origin" / "nested" / "csrc"
    shutil.copytree(CSRC, a)
    shutil.copytree(CSRC, b)
    return a, b


def test_the_build_key_does_not_depend_on_the_checkouts_path(two_checkouts):
    a, b = two_checkouts
    (b / "linear.cpp").touch()  # a checkout's files have their own mtimes too
    assert _key(a) == _key(b) == _key(CSRC)


def test_the_build_key_changes_with_a_source_byte(two_checkouts):
    a, b = two_checkouts
    text = (b / "contract.h").read_bytes()  # a header counts as much as a unit
    (b / "contract.h").write_bytes(text[:-1] + bytes([text[-1] ^ 1]))
    assert _key(a) != _key(b)


def test_the_build_key_changes_with_a_new_source_file(two_checkouts):
    a, b = two_checkouts
    (b / "extra.h").write_text("")
    assert _key(a) != _key(b)


def test_the_build_key_changes_with_the_flags_the_compiler_and_torch():
    base = _key(CSRC)
    assert _key(CSRC, flags=[*FLAGS, "-DMG_BUILT_AMX=1"]) != base
    assert _key(CSRC, compiler="c++ (GCC) 13.1.0") != base
    assert _key(CSRC, torch_version="2.14.0+cpu") != base


def test_the_build_folder_is_named_by_the_key(monkeypatch, tmp_path):
    import torch

    from margingate.kernels import isa_units
    monkeypatch.setenv("MARGINGATE_CACHE", str(tmp_path))
    extension.build_dir.cache_clear()
    try:
        folder = extension.build_dir()
    finally:
        extension.build_dir.cache_clear()
    key = extension.build_key(CSRC, extension._CFLAGS, extension._LDFLAGS,
                              isa_units.compiler_version(extension._cxx()), torch.__version__)
    assert folder == tmp_path / "kernels" / f"torch-{torch.__version__}-{key}"


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_a_stale_lock_left_by_a_dead_builder_is_cleared_with_a_message(tmp_path):
    pid = _dead_pid()
    (tmp_path / build_lock.HOLDER).write_text(f"{pid} {time.time() - 90:.0f}\n")
    (tmp_path / build_lock.BATON).write_text("")  # torch's lock, as a killed build leaves it
    said = []
    with build_lock.building(tmp_path, say=said.append, wait_limit_s=5):
        assert not (tmp_path / build_lock.BATON).exists()
        assert (tmp_path / build_lock.HOLDER).read_text().split()[0] == str(os.getpid())
    assert len(said) == 1 and "stale" in said[0] and f"pid {pid} (no longer running" in said[0]
    assert (tmp_path / build_lock.HOLDER).read_text() == ""  # a finished build leaves no holder


def test_no_message_when_no_lock_was_left(tmp_path):
    said = []
    with build_lock.building(tmp_path, say=said.append, wait_limit_s=5):
        pass
    assert said == []


def test_a_live_builder_is_waited_for_with_its_pid_then_given_up_on(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"f = open({str(tmp_path / build_lock.HOLDER)!r}, 'a+')\n"
        "fcntl.flock(f, fcntl.LOCK_EX)\n"
        "f.write(f'{os.getpid()} {time.time():.0f}\\n'); f.flush()\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        said = []
        with pytest.raises(KernelBuildError, match=f"pid {holder.pid} \\(running"):
            with build_lock.building(tmp_path, say=said.append, wait_limit_s=1):
                pass
        assert said and f"waiting for pid {holder.pid} (running" in said[0] and "giving up after 1 s" in said[0]
    finally:
        holder.kill()
        holder.wait()
    with build_lock.building(tmp_path, say=said.append, wait_limit_s=5):  # a killed holder's flock is released
        pass


def test_old_unused_builds_are_pruned_and_the_current_one_kept(tmp_path):
    old, recent, current = (tmp_path / f"torch-2.13.0+cpu-{k}" for k in ("aaaa", "bbbb", "cccc"))
    for d in (old, recent, current):
        d.mkdir()
        (d / extension.STAMP).write_text("")
    unstamped = tmp_path / "torch-2.13.0+cpu"  # an older margingate's folder: not ours to remove
    unstamped.mkdir()
    month_ago = time.time() - 40 * 86400
    os.utime(old / extension.STAMP, (month_ago, month_ago))
    os.utime(current / extension.STAMP, (month_ago, month_ago))
    assert extension.prune(tmp_path, keep=current) == [old]
    assert not old.exists() and recent.exists() and current.exists() and unstamped.exists()
