"""attention ops (reference): filled in by the attention kernel work; registers nothing yet."""


def register(registry) -> None:
    """Register this family's ops (none yet)."""
