"""Command line: argument parsing only; the work happens in the layers below."""
from __future__ import annotations

import argparse
import sys

from .commands import (
    bench,
    calibrate,
    check,
    demo,
    embed,
    export,
    flips,
    generate,
    linear_bench,
    score,
    score_bench,
    selftest,
    serve,
    spec_bench,
)
from .data.prompts import PromptFileError
from .errors import KernelBuildError

#: every subcommand is declared beside its code by the module's add_parser(sub); this order is --help's
COMMANDS = (generate, check, demo, serve, embed, export, bench, flips, calibrate, score, score_bench, spec_bench,
            linear_bench, selftest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="margingate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)
    except (PromptFileError, ValueError, FileNotFoundError, KernelBuildError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return status or 0


if __name__ == "__main__":
    sys.exit(main())
