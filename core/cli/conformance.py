"""``shardwise conformance``: run the accelerator conformance suite against an installed plugin."""


def add_parser(sub):
    return sub.add_parser("conformance", help="run the accelerator conformance suite")


def run(args) -> int:
    raise NotImplementedError
