"""Command-line tools (rtattn-inspect, rtattn-compile) and the error convention they share:
a bad argument or input is one line on stderr, `<prog>: <what is wrong>`, and exit status 2;
never a traceback."""
from __future__ import annotations

import argparse
import sys


class CliError(Exception):
    """A user error: the message is printed as one line."""


class Parser(argparse.ArgumentParser):
    """argparse that shows defaults in --help and reports a bad argument as one CliError line
    (argparse's own error() prints the usage block too)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise CliError(message)


def run(prog: str, main, argv) -> int:
    """main(argv) -> exit status, with CliError and bad-input errors turned into one line + 2."""
    try:
        return main(argv)
    except (CliError, ValueError, TypeError, OSError) as e:
        msg = " ".join(str(e).split()) or type(e).__name__   # one line, whatever the message holds
        print(f"{prog}: {msg}", file=sys.stderr)
        return 2
