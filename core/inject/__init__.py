"""Kernel injection: ``shardwise.inject``.

Family policies describe their layers as data (:class:`InjectionSpec`); :func:`inject_model`
replaces a model's decoder stack in place with shardwise's inference layers built from the kernels
the accelerator resolves, over a static KV cache of ``max_tokens`` tokens
(:class:`StaticKVCache`); :func:`enable_graphs` captures the decode step with the accelerator's
graph strategy. The HF model stays the outer shell: ``generate()``/``pipeline()`` keep working.
"""

from .cache import KVBuffers, MaxTokensError, StaleCacheError, StaticKVCache
from .injector import (DecodeGraphs, InjectionError, enable_graphs, inject_model, injected_stack,
                       resolve_kernels, supported_families)
from .layers import InjectedLayer, InjectedModel
from .spec import ACTIVATIONS, InjectionSpec

__all__ = ["KVBuffers", "MaxTokensError", "StaleCacheError", "StaticKVCache", "DecodeGraphs",
           "InjectionError", "enable_graphs", "inject_model", "injected_stack", "resolve_kernels",
           "supported_families", "InjectedLayer", "InjectedModel", "ACTIVATIONS", "InjectionSpec"]
