"""The error every validator raises for a bad option: the message, and the field it names (the HTTP
server turns it into a 400 whose `param` is that field)."""
from __future__ import annotations


class OptionError(ValueError):
    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option
