"""shardwise-example: the template accelerator plugin a hardware vendor copies.

It registers an accelerator named ``example`` (entry-point group ``shardwise.accelerators``) and a
kernel backend named ``example`` (group ``shardwise.kernels``). The device is a demonstration: it
runs on CPU tensors and is available only when ``SHARDWISE_EXAMPLE_ENABLE=1``. Keep this module
light: shardwise imports plugin modules while discovering devices, so nothing here may import a
device runtime.
"""

from .accelerator import ENABLE_ENV, ExampleAccelerator

__all__ = ["ENABLE_ENV", "ExampleAccelerator"]
__version__ = "0.1.0"
