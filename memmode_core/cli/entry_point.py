"""``main``: the ``memmode`` console script — parse, run the subcommand, return its exit status.

Exit status: 0 on success; 2 for a usage error or a ``MemmodeError`` (printed as one line, no traceback:
what a user can fix needs no stack), and for ``run --compare`` when every mode was refused; 141 when the
reader of stdout went away early (``memmode list | head -1``), quietly, as other command-line tools do.
"""

from __future__ import annotations

import os
import sys

import memmode_core as memmode
from memmode_core.cli.parser import build_parser
from memmode_core.cli.plugin_options import given_options

#: exit status when the reader of stdout went away (128 + SIGPIPE, what a shell reports for ``cmd | head``)
BROKEN_PIPE_STATUS = 141


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        args.options = given_options(parser, args)
        try:
            status = args.func(args)
        except memmode.MemmodeError as exc:
            print(f"memmode: error: {exc}", file=sys.stderr)
            status = 2
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return status
    except BrokenPipeError:
        _discard_stdout()
        return BROKEN_PIPE_STATUS


def _discard_stdout() -> None:
    """The reader of stdout went away (``memmode list | head -1``): what is still buffered goes to
    devnull, so that the interpreter's final flush does not print a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # no real stdout (captured, closed): nothing to redirect
        pass
