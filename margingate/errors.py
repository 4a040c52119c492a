"""The errors that any layer may raise and the command line reports as one line, not a traceback, and
`notice`, a line on stderr that is not an error: imported by everything, importing nothing."""
from __future__ import annotations


class OptionError(ValueError):
    """What every validator raises for a bad option: the message, and the field it names (the HTTP
    server turns it into a 400 whose `param` is that field)."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


class KernelBuildError(RuntimeError):
    """The invariant kernels could not be built or cannot run on this CPU."""


def notice(line: str) -> None:
    """One line on stderr for what a user waits on or should know, outside any report (a kernel build,
    a cache file rebuilt): stdout stays the command's output."""
    import sys

    print(f"margingate: {line}", file=sys.stderr, flush=True)
