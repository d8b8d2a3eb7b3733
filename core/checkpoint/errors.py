"""The checkpoint error: bad input, named (the file, the tensor, both shapes, the keys)."""

from ..errors import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint (directory, description file or shard file) is missing, malformed, or does not
    fit the model. Raised before heavy work whenever the problem is knowable from headers."""


class ExpertCountError(CheckpointError):
    """A Mixture-of-Experts checkpoint holds another number of experts per layer than the model
    built from the config. Raised from the files' headers, before any weight is read."""
