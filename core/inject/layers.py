"""shardwise's inference decoder: one generic layer driven by :class:`InjectionSpec` data.

Design (why the whole decoder stack, not an attention function in transformers' registry):
the injected path owns one forward for the stack — embeddings, every layer, the final norm —
and swaps it for the base model (``model.model`` / ``model.transformer``) of the causal-LM
shell, which keeps ``lm_head``, ``generate()``, ``pipeline()`` and the weights' names
(``state_dict``/``save_pretrained`` unchanged: the new modules *adopt* the HF children under their
own names, nothing is copied). Owning the stack forward is what lets it (1) skip the HF per-step
work the kernels make redundant (4-d mask construction, per-layer rotary/cos tables, cache
concatenation), (2) keep one static KV cache per model and (3) hand the *whole* decode step to
the accelerator's graph strategy as one function of static tensors — registering only an
attention function (``AttentionInterface``) would leave the stack forward, its masks and its
cache growth in HF's hands and allow no whole-step capture. transformers' own extension points
are still what ``generate`` sees: the cache is a :class:`transformers.Cache` subclass
(:class:`~shardwise.inject.cache.StaticKVCache`), so beam reordering and cropping go through
its interface. Everything is per instance: no class or function of transformers is patched.

Tensor parallelism: the layers call the (already sharded) HF projection modules as modules, so
the row-parallel all-reduce and vocab-parallel hooks installed by :mod:`shardwise.sharding` run
through the engine's communicator; head counts are read from the local weight shapes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions as StackOutput

from ..errors import ShardwiseError
from .cache import KVBuffers, StaticKVCache
from .spec import InjectionSpec

log = logging.getLogger(__name__)


def out_width(module: nn.Module) -> int:
    """Output features of a Linear or transformers Conv1D (weight [in, out])."""
    if isinstance(module, nn.Linear):
        return module.weight.shape[0]
    if hasattr(module, "nf"):
        return module.weight.shape[1]
    raise ShardwiseError(f"cannot read the output width of {type(module).__name__}")


@dataclass
class Kernels:
    """The op implementations one injected model calls (resolved once, for its dtype)."""

    norm: Callable
    rotary: Callable
    act: Callable
    attention_prefill: Callable
    attention_decode: Callable
    kv_cache_write: Callable
    backends: dict[str, str]


@dataclass
class StepContext:
    """What every layer of one forward shares."""

    cache: StaticKVCache | None
    past: int
    decode: bool
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    write_pos: int = 0
    lengths: torch.Tensor | None = None
    starts: torch.Tensor | None = None
    key_padding_mask: torch.Tensor | None = None
    graph_safe: bool = False  # decode step under graph capture: no host syncs
    write_index: torch.Tensor | None = None  # [1] int64, graph_safe only
    visible: torch.Tensor | None = None  # [batch, 1, 1, max_tokens] bool, graph_safe only


class _Refs:
    """Plain (unregistered) references to modules the layer adopted under their own names."""

    def __init__(self, **modules: Any) -> None:
        self.__dict__.update(modules)


class InjectedLayer(nn.Module):
    """One decoder layer: fused residual+norm, attention over the static cache, MLP."""

    def __init__(self, hf_layer: nn.Module, spec: InjectionSpec, kernels: Kernels, index: int,
                 head_dim: int, q_share: float, scale: float, act: tuple[str, str]) -> None:
        super().__init__()
        for name, child in hf_layer.named_children():  # adopt: same names, same parameters
            self.add_module(name, child)
        self.spec, self.k, self.index = spec, kernels, index
        self.rebind()
        qkv = self.m.qkv
        self.head_dim = head_dim
        if len(qkv) == 1:
            width = out_width(qkv[0])
            q_width = round(width * q_share / head_dim) * head_dim
            kv_width = (width - q_width) // 2
            self.widths = [q_width, kv_width, kv_width]
        else:
            self.widths = [out_width(p) for p in qkv]
        self.q_heads, self.kv_heads = self.widths[0] // head_dim, self.widths[1] // head_dim
        self.scale = scale
        self.approximate = act[1]
        self.fused_qkv = len(qkv) == 1

    def rebind(self) -> None:
        """(Re)read the adopted submodules named by the spec (after a transform replaced some,
        e.g. quantized linears)."""
        get, spec = self.get_submodule, self.spec
        self.m = _Refs(norm1=get(spec.attn_norm),
                       norm2=get(spec.mlp_norm) if spec.mlp_norm else None,
                       qkv=tuple(get(n) for n in spec.qkv), out=get(spec.out_proj),
                       mlp_in=tuple(get(n) for n in spec.mlp_in), mlp_out=get(spec.mlp_out))

    def _norm(self, module: nn.Module, x: torch.Tensor, residual: torch.Tensor | None):
        eps = getattr(module, "variance_epsilon", None)
        eps = module.eps if eps is None else eps
        if self.spec.norm == "rms":
            return self.k.norm(x, module.weight, eps, residual=residual)
        return self.k.norm(x, module.weight, module.bias, eps, residual=residual)

    def forward(self, delta: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext):
        h, residual = self._norm(self.m.norm1, delta, residual)
        a = self._attention(h, ctx)
        if self.spec.parallel_residual:
            h2 = h if self.m.norm2 is None else self._norm(self.m.norm2, residual, None)[0]
            return a + self._mlp(h2), residual
        h2, residual = self._norm(self.m.norm2, a, residual)
        return self._mlp(h2), residual

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.spec.mlp == "gated":
            gate, up = self.m.mlp_in
            return self.m.mlp_out(self.k.act(gate(h), up(h)))
        return self.m.mlp_out(self.k.act(self.m.mlp_in[0](h), None, self.approximate))

    def _attention(self, h: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        b, s, _ = h.shape
        d, hq, hkv = self.head_dim, self.q_heads, self.kv_heads
        if self.fused_qkv:
            q, k, v = self.m.qkv[0](h).split(self.widths, dim=-1)
        else:
            q, k, v = (p(h) for p in self.m.qkv)
        q = q.view(b, s, hq, d).transpose(1, 2)
        k = k.view(b, s, hkv, d).transpose(1, 2)
        v = v.view(b, s, hkv, d).transpose(1, 2)
        if ctx.cos is not None:
            q, k = self.k.rotary(q, k, ctx.cos, ctx.sin, style=self.spec.rotary_style)
        cache = ctx.cache
        if cache is None:
            o = self.k.attention_prefill(q, k, v, causal=True,
                                         key_padding_mask=ctx.key_padding_mask, scale=self.scale)
        else:
            kc, vc = cache.buffers.k[self.index], cache.buffers.v[self.index]
            if ctx.graph_safe:  # no host sync: index_copy_ at a device index, masked SDPA
                kc.index_copy_(2, ctx.write_index, k)
                vc.index_copy_(2, ctx.write_index, v)
                o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=ctx.visible,
                                                   scale=self.scale, enable_gqa=hq != hkv)
            else:
                self.k.kv_cache_write(kc, vc, k, v, ctx.write_pos)
                if ctx.decode:
                    o = self.k.attention_decode(q, kc, vc, ctx.lengths, scale=self.scale,
                                                starts=ctx.starts)
                elif ctx.past == 0:
                    o = self.k.attention_prefill(q, k, v, causal=True,
                                                 key_padding_mask=ctx.key_padding_mask,
                                                 scale=self.scale)
                else:  # a prompt continued after cached tokens
                    n = ctx.past + s
                    o = self.k.attention_prefill(q, kc[:, :, :n], vc[:, :, :n], causal=True,
                                                 key_padding_mask=ctx.key_padding_mask,
                                                 scale=self.scale)
        return self.m.out(o.transpose(1, 2).reshape(b, s, hq * d))


class InjectedModel(nn.Module):
    """The decoder stack that replaces the HF base model (see the module docstring)."""

    def __init__(self, hf_base: nn.Module, spec: InjectionSpec, kernels: Kernels,
                 max_tokens: int, head_dim: int, q_share: float, scales: list[float],
                 act: tuple[str, str]) -> None:
        super().__init__()
        self.config = hf_base.config
        self.spec, self.k, self.max_tokens, self.head_dim = spec, kernels, max_tokens, head_dim
        hf_layers = hf_base.get_submodule(spec.layers)
        layers = nn.ModuleList(InjectedLayer(layer, spec, kernels, i, head_dim, q_share,
                                             scales[i], act)
                               for i, layer in enumerate(hf_layers))
        for name, child in hf_base.named_children():  # same names, same order
            self.add_module(name, layers if child is hf_layers else child)
        self._layers = [layers]  # unregistered handle (the ModuleList is registered above)
        self.rebind()
        self.kv_heads = layers[0].kv_heads if len(layers) else 0
        self._kv: KVBuffers | None = None
        self._cache_generation = 0
        self.graphs: Any = None  # a DecodeGraphs when graph capture is on

    def rebind(self) -> None:
        """(Re)read every adopted submodule the forward calls (see :meth:`InjectedLayer.rebind`)."""
        spec, get = self.spec, self.get_submodule
        layers = self._layers[0]
        for layer in layers:
            layer.rebind()
        self.m = _Refs(layers=layers, embed=get(spec.embed), final_norm=get(spec.final_norm),
                       pos_embed=get(spec.pos_embed) if spec.pos_embed else None,
                       rotary=get(spec.rotary_module) if spec.rotary_module else None)

    # HF helpers the shell delegates to its base model
    def get_input_embeddings(self) -> nn.Module:
        return self.m.embed

    def set_input_embeddings(self, value: nn.Module) -> None:
        raise ShardwiseError("the input embeddings of an injected model cannot be replaced")

    # ----- the cache -----------------------------------------------------------------------------

    def new_cache(self, batch: int, dtype: torch.dtype, device: torch.device) -> StaticKVCache:
        """A fresh cache (retiring the previous one) over buffers for ``batch`` sequences."""
        if self._kv is None or not self._kv.matches(batch, dtype, device):
            self._kv = None
            if self.graphs is not None:
                self.graphs.clear()
            self._kv = KVBuffers(len(self.m.layers), batch, self.kv_heads, self.max_tokens,
                                      self.head_dim, dtype, device)
        self._cache_generation += 1
        return StaticKVCache(self._kv, self, self._cache_generation)

    def _cache_for(self, past: Any, batch: int, x: torch.Tensor,
                   use_cache: bool) -> StaticKVCache | None:
        if isinstance(past, StaticKVCache):
            past.check_live()
            if past.buffers.batch != batch:
                raise ShardwiseError(f"the cache holds {past.buffers.batch} sequences but the "
                                     f"input has {batch}")
            return past
        if past is not None and past.get_seq_length() > 0:
            raise ShardwiseError(f"an injected model runs with its own static KV cache; got a "
                                 f"{type(past).__name__} that already holds tokens")
        return self.new_cache(batch, x.dtype, x.device) if use_cache else None

    # ----- forward -----------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor | None = None, past_key_values: Any = None,
                attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> StackOutput:
        if output_attentions or output_hidden_states or encoder_hidden_states is not None:
            raise ShardwiseError("the injected model does not return attentions or hidden states "
                                 "and has no cross-attention; init_inference without "
                                 "replace_with_kernel_inject runs the HF layers that do")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ShardwiseError("the injected model takes a 2-d [batch, tokens] attention_mask")
        ref = input_ids if input_ids is not None else inputs_embeds
        b, s = ref.shape[:2]
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        dtype = self.m.final_norm.weight.dtype
        cache = self._cache_for(past_key_values, b, self.m.final_norm.weight, use_cache)
        past = cache.length if cache is not None else 0
        write_pos = cache.reserve(s) if cache is not None else 0
        decode = cache is not None and s == 1 and past > 0
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=ref.device)[None]
        position_ids = position_ids.expand(b, s)
        if decode and self.graphs is not None and input_ids is not None:
            hidden = self.graphs.run(self, cache, input_ids, position_ids, past)
            cache.length = past + 1
            return StackOutput(last_hidden_state=hidden, past_key_values=cache)
        ctx = StepContext(cache, past, decode, write_pos=write_pos)
        self._padding(ctx, attention_mask, cache, past, s)
        x = self.m.embed(input_ids) if inputs_embeds is None else inputs_embeds.to(dtype)
        x = self._positions(ctx, x, position_ids)
        if token_type_ids is not None:
            x = x + self.m.embed(token_type_ids.expand(b, s))
        if decode:
            ctx.lengths = torch.full((b,), past + 1, dtype=torch.int64, device=x.device)
        hidden = self.run_layers(x, ctx)
        if cache is not None:
            cache.length = past + s
        return StackOutput(last_hidden_state=hidden, past_key_values=cache)

    def run_layers(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        delta, residual = x, None
        for layer in self.m.layers:
            delta, residual = layer(delta, residual, ctx)
        return self._final_norm(delta, residual)

    def _final_norm(self, delta, residual):
        return self.m.layers[0]._norm(self.m.final_norm, delta, residual)[0] if len(
            self.m.layers) else self.m.final_norm(delta)

    def _positions(self, ctx: StepContext, x: torch.Tensor,
                   position_ids: torch.Tensor) -> torch.Tensor:
        if self.spec.positions == "learned":
            return x + self.m.pos_embed(position_ids)
        probe = torch.empty(0, dtype=torch.float32, device=x.device)
        cos, sin = self.m.rotary(probe, position_ids)  # HF's own table: rope scaling included
        half = cos.shape[-1] // 2
        ctx.cos, ctx.sin = cos[..., :half], sin[..., :half]
        return x

    @staticmethod
    def _padding(ctx: StepContext, mask: torch.Tensor | None, cache: StaticKVCache | None,
                 past: int, s: int) -> None:
        """Left padding: the first real token of each sequence (``starts``) and, for prompts,
        the key padding mask. Masks with holes after the first real token are refused."""
        if cache is not None:
            ctx.starts = cache.starts
        if mask is None or ctx.decode:
            return
        mask = mask[:, :past + s].bool()
        if bool(mask.all()):
            return
        if past == 0:
            starts = mask.int().argmax(-1)
            pos = torch.arange(s, device=mask.device)
            if not torch.equal(mask, pos[None] >= starts[:, None]):
                raise ShardwiseError("the injected model supports left padding only (each "
                                     "sequence's attention_mask is 0s, then 1s); got a mask with "
                                     "holes. Pad on the left (tokenizer.padding_side='left')")
            ctx.starts = starts
            if cache is not None:
                cache.starts = starts
        ctx.key_padding_mask = mask

    # ----- graph-safe decode step ----------------------------------------------------------------

    def decode_step(self, cache: StaticKVCache, input_ids: torch.Tensor,
                    position_ids: torch.Tensor, write_index: torch.Tensor,
                    lengths: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """One decode step with static shapes and no host sync (what graph strategies capture):
        input_ids/position_ids [batch, 1], write_index [1], lengths/starts [batch] → hidden
        [batch, 1, hidden] after the final norm."""
        ctx = StepContext(cache, past=-1, decode=True, graph_safe=True, write_index=write_index)
        slots = torch.arange(cache.buffers.max_tokens, device=input_ids.device)
        ctx.visible = ((slots[None] >= starts[:, None]) & (slots[None] < lengths[:, None])
                       )[:, None, None, :]
        x = self._positions(ctx, self.m.embed(input_ids), position_ids)
        return self.run_layers(x, ctx)
