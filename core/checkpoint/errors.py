"""The checkpoint error: bad input, named (the file, the tensor, both shapes, the keys)."""

from ..errors import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint (directory, description file or shard file) is missing, malformed, or does not
    fit the model. Raised before heavy work whenever the problem is knowable from headers."""
