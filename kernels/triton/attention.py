"""attention ops as Triton kernels: filled in by the attention kernel work; registers nothing yet."""


def register(registry) -> None:
    """Register this family's Triton kernels (none yet)."""
