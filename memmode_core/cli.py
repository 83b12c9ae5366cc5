"""The ``memmode`` command."""

from __future__ import annotations

import argparse
import json
import sys

from . import __version__
from .errors import MemmodeError


def _cmd_list(args: argparse.Namespace) -> int:
    from .plugins import list_plugins
    from .table import render

    rows = list_plugins()
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
        return 0
    print(render(
        ["kind", "name", "distribution", "version", "available", "description"],
        [(r.kind, r.name, r.distribution, r.version or "-", "yes" if r.available else f"no: {r.reason}",
          r.description) for r in rows],
    ))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memmode", description="GPU memory modes for diffusers pipelines.")
    parser.add_argument("--version", action="version", version=f"memmode {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")

    listing = commands.add_parser("list", help="what is installed: placements, quantizers, storages")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(func=_cmd_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MemmodeError as exc:
        print(f"memmode: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
