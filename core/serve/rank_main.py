"""One rank of ``shardwise serve --tp N``, started by ``shardwise launch`` (which has already
applied the accelerator's per-rank settings).

``python -m shardwise.serve.rank_main <shardwise serve options>``: rank 0 serves HTTP and runs
the scheduler; every other rank follows rank 0's steps until it closes (see
:func:`shardwise.serve.server.run_rank`). Exit code 0 after a clean stop, 2 for bad options,
1 when the model side failed (a rank died, a collective timed out).
"""

from __future__ import annotations

import sys

from ..errors import ConfigError, ShardwiseError


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank."""
    from ..cli.serve import rank_parser
    from .server import run_rank

    args = rank_parser("python -m shardwise.serve.rank_main").parse_args(
        sys.argv[1:] if argv is None else argv)
    try:
        return run_rank(args)
    except ShardwiseError as exc:
        print(f"shardwise serve: error: {exc}", file=sys.stderr, flush=True)
        return 2 if isinstance(exc, ConfigError) else 1


if __name__ == "__main__":
    sys.exit(main())
