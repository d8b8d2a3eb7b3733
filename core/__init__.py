"""shardwise: transformer inference on any hardware, through pluggable accelerators.

``import shardwise`` imports no device runtime and no kernel backend; those load on first use.

>>> import shardwise, torch
>>> engine = shardwise.init_inference(model, device="cpu", dtype=torch.bfloat16)  # doctest: +SKIP
>>> engine.module.generate(**inputs)  # doctest: +SKIP
"""

from .accelerator import PLUGIN_API_VERSION, Accelerator, Availability, GraphStrategy
from .communicator import Communicator, LocalCommunicator, TorchDistCommunicator
from .config import InferenceConfig
from .engine import InferenceEngine, init_inference
from .errors import (AcceleratorUnavailableError, CollectiveError, ConfigError, KernelError,
                     NotSupportedYetError, PluginError, ShardwiseError, UnsupportedDtypeError)
from .plugins import describe_accelerators, get_accelerator, refresh_plugins

__version__ = "0.1.0"

__all__ = [
    "PLUGIN_API_VERSION", "Accelerator", "Availability", "GraphStrategy", "Communicator",
    "LocalCommunicator", "TorchDistCommunicator", "InferenceConfig", "InferenceEngine",
    "init_inference", "AcceleratorUnavailableError", "CollectiveError", "ConfigError",
    "KernelError", "NotSupportedYetError", "PluginError", "ShardwiseError",
    "UnsupportedDtypeError", "describe_accelerators", "get_accelerator",
    "refresh_plugins", "__version__",
]
