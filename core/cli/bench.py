"""``shardwise bench`` (filled in by the bench work)."""


def add_parser(sub):
    return sub.add_parser("bench", help="benchmark shardwise against the plain HF model")


def run(args) -> int:
    raise NotImplementedError
