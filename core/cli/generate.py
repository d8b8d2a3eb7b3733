"""``shardwise generate``: load a model, run it through init_inference, print text and latency."""


def add_parser(sub):
    p = sub.add_parser("generate", help="generate text with a model (default: embedded SmolLM2)")
    return p


def run(args) -> int:
    raise NotImplementedError
