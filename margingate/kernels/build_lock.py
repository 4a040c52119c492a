"""The kernel build's lock: one builder per build folder, and a build that was killed never blocks a later start.

torch's cpp_extension guards a build with a file of its own (`lock`, created with O_EXCL and removed when the
build ends). A process killed while building leaves that file behind, and every later `load` would wait on it
forever. So a build here first takes `builder.lock` with flock, which the kernel releases when its holder
dies however it dies, and writes its pid and start time into it. Whoever holds that flock and still finds
torch's `lock` knows it is stale, since no live builder can be holding it, and removes it, saying whose it was.
A process that finds the flock held waits for the live builder, saying who it is every half minute, and gives
up with an error after WAIT_LIMIT_S rather than hang.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import KernelBuildError, notice

HOLDER = "builder.lock"  # flock'd while a build runs; holds the builder's "pid start-time"
BATON = "lock"           # torch.utils.file_baton's file in the build folder
WAIT_LIMIT_S = 20 * 60   # a build takes 1-3 minutes on 2 cores; far longer means the builder is stuck
REPORT_EVERY_S = 30


@contextlib.contextmanager
def building(folder: Path, say: Callable[[str], None] = notice,
             wait_limit_s: float = WAIT_LIMIT_S) -> Iterator[None]:
    """Hold the build lock of `folder` (waiting for a live builder, clearing what a dead one left)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / HOLDER, "a+") as f:
        _acquire(f, folder, say, wait_limit_s)
        try:
            f.seek(0)
            previous = f.read().strip()
            clear_stale_baton(folder, previous, say)
            f.seek(0)
            f.truncate()
            f.write(f"{os.getpid()} {time.time():.0f}\n")
            f.flush()
            yield
        finally:
            f.truncate(0)  # a finished build leaves no holder to report
            fcntl.flock(f, fcntl.LOCK_UN)


def _acquire(f, folder: Path, say: Callable[[str], None], wait_limit_s: float) -> None:
    start = last_report = None
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        now = time.monotonic()
        start = start if start is not None else now
        holder = describe_holder((folder / HOLDER).read_text().strip())
        if now - start > wait_limit_s:
            raise KernelBuildError(f"{holder} has been building margingate's kernels in {folder} for over "
                                   f"{wait_limit_s:.0f} s; if it is stuck, stop it and start again")
        if last_report is None or now - last_report >= REPORT_EVERY_S:
            say(f"waiting for {holder}, which is building margingate's kernels in {folder} "
                f"(waited {now - start:.0f} s; a build takes 1-3 minutes on 2 cores; giving up after "
                f"{wait_limit_s:.0f} s)")
            last_report = now
        time.sleep(0.2)


def clear_stale_baton(folder: Path, previous_holder: str, say: Callable[[str], None]) -> bool:
    """Remove torch's `lock` from `folder` if it is there (call with the build lock held: then no live
    builder owns it); `previous_holder`: what the last builder wrote into HOLDER ("" if it finished)."""
    baton = folder / BATON
    if not baton.exists():
        return False
    age = time.time() - baton.stat().st_mtime
    who = describe_holder(previous_holder) if previous_holder else "a build by an older margingate"
    say(f"removing a stale kernel build lock {baton} ({age:.0f} s old), left by {who}, which stopped before "
        "its build finished")
    baton.unlink(missing_ok=True)
    return True


def describe_holder(record: str) -> str:
    """ "pid N (running|no longer running), started T s ago" from HOLDER's "pid start-time" record."""
    try:
        pid, started = (int(float(v)) for v in record.split())
    except ValueError:
        return "another process"
    state = "running" if pid_alive(pid) else "no longer running"
    return f"pid {pid} ({state}, started {time.time() - started:.0f} s ago)"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
