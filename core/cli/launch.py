"""``shardwise launch``: start N ranks per node through torch's elastic launcher, each rank set up
for the accelerator (see :mod:`shardwise.launch`). Every word after ``launch`` goes to that
launcher untouched, so ``shardwise launch --help`` shows torchrun's options and shardwise's."""

from __future__ import annotations

import argparse


def add_parser(sub):
    """Register ``launch``; it takes the rest of the command line as it is (no option parsing
    here: ``prefix_chars`` that never match keep argparse from reading torchrun's options)."""
    p = sub.add_parser("launch", add_help=False, prefix_chars="\0",
                       help="start N ranks per node like torchrun, set up for the accelerator "
                            "(shardwise launch --help)")
    p.add_argument("argv", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``shardwise launch``; the launcher's exit code."""
    from ..launch import main

    return main(args.argv, prog="shardwise launch")
