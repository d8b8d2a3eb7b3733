"""Exceptions raised by shardwise.

Every error says what was wrong and what to do about it. They subclass the builtin a caller would
naturally catch (``ValueError`` for bad input, ``RuntimeError`` for an environment problem), so
existing ``except`` clauses keep working.
"""


class ShardwiseError(Exception):
    """Base class of every shardwise error."""


class ConfigError(ShardwiseError, ValueError):
    """An inference config field is unknown, malformed, or conflicts with another value."""


class NotSupportedYetError(ConfigError):
    """A known config field asks for a feature this version of shardwise does not provide."""


class PluginError(ShardwiseError, RuntimeError):
    """A plugin is unknown, failed to load, or was built for another plugin-API version."""


class AcceleratorUnavailableError(PluginError):
    """The accelerator plugin is installed but cannot run on this machine (the reason is given)."""


class UnsupportedDtypeError(ShardwiseError, ValueError):
    """The chosen accelerator cannot run the requested dtype."""


class CollectiveError(ShardwiseError, RuntimeError):
    """A collective failed or timed out, typically because another rank died."""


class KernelError(ShardwiseError, RuntimeError):
    """A kernel op is unknown or no backend can run it for the given inputs."""
