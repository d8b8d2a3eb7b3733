"""quant ops (cpu): filled in by the quant kernel work; registers nothing yet."""


def register(registry) -> None:
    """Register this family's ops (none yet)."""
