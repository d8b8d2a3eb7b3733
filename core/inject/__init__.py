"""Kernel injection: ``shardwise.inject``.

Family policies describe their layers as data (:class:`InjectionSpec`: module names and the
:class:`Positions`, :class:`Attention`, :class:`MLP` and :class:`Residual` groups);
:func:`inject_model` replaces a model's decoder stack in place with shardwise's inference layers
built from the kernels the accelerator resolves, over a static KV cache of ``max_tokens`` tokens
(:class:`StaticKVCache`); :func:`enable_graphs` captures the decode step with the accelerator's
graph strategy. The HF model stays the outer shell: ``generate()``/``pipeline()`` keep working.
Encoder-only families (BERT) describe theirs with :class:`EncoderInjectionSpec` (groups
:class:`EncoderAttention`, :class:`EncoderMLP`); the same
:func:`inject_model` replaces their encoder (:class:`InjectedEncoder`, no KV cache).
"""

from .cache import (ConcurrentUseError, KVBuffers, KVCacheMemoryError, MaxTokensError,
                    StaleCacheError, StaticKVCache)
from .capture import DecodeGraphs, HeadFromGraph, enable_graphs
from .injector import (InjectionError, check_injection, inject_model, injected_stack,
                       resolve_kernels, resolve_ops, supported_families)
from .encoder import (EncoderAttention, EncoderInjectionSpec, EncoderMLP, InjectedEncoder,
                      inject_encoder, injected_encoder)
from .layers import InjectedLayer, InjectedModel
from .spec import ACTIVATIONS, MLP, Attention, InjectionSpec, MovedFieldError, Positions, Residual

__all__ = ["ConcurrentUseError", "KVBuffers", "KVCacheMemoryError", "MaxTokensError",
           "StaleCacheError", "StaticKVCache", "DecodeGraphs",
           "HeadFromGraph", "InjectionError", "check_injection", "enable_graphs", "inject_model",
           "injected_stack",
           "resolve_kernels", "resolve_ops", "supported_families", "EncoderInjectionSpec",
           "InjectedEncoder", "inject_encoder", "injected_encoder", "InjectedLayer",
           "InjectedModel", "ACTIVATIONS", "InjectionSpec", "Positions", "Attention", "MLP",
           "Residual", "MovedFieldError", "EncoderAttention", "EncoderMLP"]
