"""The errors that any layer may raise and the command line reports as one line, not a traceback:
imported by everything, importing nothing."""
from __future__ import annotations


class OptionError(ValueError):
    """What every validator raises for a bad option: the message, and the field it names (the HTTP
    server turns it into a 400 whose `param` is that field)."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


class KernelBuildError(RuntimeError):
    """The invariant kernels could not be built or cannot run on this CPU."""
