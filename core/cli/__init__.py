"""The ``shardwise`` command line. Each subcommand is a module here with ``add_parser`` and
``run``; :data:`SUBCOMMANDS` lists them in help order."""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import ShardwiseError

#: subcommand name → module (relative to this package) providing add_parser(subparsers) and run(args)
SUBCOMMANDS = {
    "accelerators": ".accelerators",
    "generate": ".generate",
    "conformance": ".conformance",
    "bench": ".bench",
    "launch": ".launch",
    "serve": ".serve",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise", description="Transformer inference on any hardware.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in SUBCOMMANDS.items():
        mod = importlib.import_module(module, __name__)
        mod.add_parser(sub).set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardwise`` script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ShardwiseError as exc:
        print(f"shardwise: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
