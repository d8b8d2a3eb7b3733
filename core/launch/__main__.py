"""``python -m shardwise.launch``: the same as ``shardwise launch``."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m shardwise.launch"))
