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

import contextlib
import dataclasses
import functools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions as StackOutput
from transformers.modeling_outputs import MoeModelOutputWithPast

from shardwise.kernels.reference.attention import softmax_with_sinks
from shardwise.kernels.reference.rotary import rotary_cos_sin

from ..errors import ShardwiseError
from .cache import (THREADS_HINT, ConcurrentUseError, DecodeRows, KVBuffers, MixedRows,
                    StaticKVCache, check_kv_fits, free_memory_of, kv_cache_bytes,
                    kv_memory_error, write_rows)
from .mla import latent_core
from .spec import InjectionSpec

log = logging.getLogger(__name__)


def out_width(module: nn.Module) -> int:
    """Output features of a Linear (or any module with ``out_features``, e.g. a quantized one)
    or transformers Conv1D (weight [in, out])."""
    if isinstance(module, nn.Linear):
        return module.weight.shape[0]
    if isinstance(getattr(module, "out_features", None), int):
        return module.out_features
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
    #: the packed prompt chunks of a served mixed step (reference ``attention_chunks``)
    attention_chunks: Callable
    backends: dict[str, str]
    #: attention_decode may run in the captured decode step (it reads lengths/starts there);
    #: else the step attends, masked, over the whole static cache
    decode_capturable: bool = False
    #: attention_chunks may run inside a captured mixed step (it reads the spans inside the op:
    #: under any graph strategy); else the step calls attention_prefill per chunk through the
    #: host op ``shardwise::chunks_by_prefill``, which only a strategy replaying host code captures
    chunks_capturable: bool = False


@dataclass
class StepContext:
    """What every layer of one forward shares."""

    cache: StaticKVCache | None
    past: int  # tokens already in the cache (-1 in the graph-safe step: read from lengths)
    decode: bool  # one new token per sequence after cached ones
    cos: torch.Tensor | None = None  # rotary table [b, s, rotary_dim // 2] float32
    sin: torch.Tensor | None = None
    #: the cache position of this forward's first token: an int (a prompt), or per row
    #: [b] int64 (decode: DecodeRows.write_index)
    write_pos: int | torch.Tensor = 0
    lengths: torch.Tensor | None = None  # [b] int64: valid cache slots per sequence (decode)
    starts: torch.Tensor | None = None  # [b] int64: each sequence's first real token
    key_padding_mask: torch.Tensor | None = None  # [b, past + s] bool, True = a real token
    graph_safe: bool = False  # decode step under graph capture: no host syncs
    write_index: torch.Tensor | None = None  # [b] int64 per-row write position, graph_safe only
    masks: dict = field(default_factory=dict)  # graph_safe: (window, alibi id) → SDPA mask
    #: a mixed forward (decode tokens and prompt chunks packed in one row): where each goes
    mixed: MixedRows | None = None

    def mask_for(self, layer: "InjectedLayer") -> torch.Tensor:
        """Graph-safe decode: ``layer``'s SDPA mask over the whole cache, built once per step
        for each distinct (window, ALiBi) — bool [batch, 1, 1, max_tokens], or with ALiBi the
        float bias [batch, q_heads, 1, max_tokens] (-inf where a key is not visible)."""
        window, slopes = layer.setup.window, layer.alibi_slopes
        key = (window, None if slopes is None else id(slopes))
        if key not in self.masks:
            self.masks[key] = self._mask(window, slopes, self.cache.buffers.dtype)
        return self.masks[key]

    def _mask(self, window: int | None, slopes: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
        max_tokens = self.cache.buffers.max_tokens
        slots = torch.arange(max_tokens, device=self.lengths.device)[None]  # [1, max_tokens]
        first = self.starts[:, None]
        if window is not None:
            first = torch.maximum(first, self.lengths[:, None] - window)
        visible = (slots >= first) & (slots < self.lengths[:, None])  # [batch, max_tokens]
        if slopes is None:
            return visible[:, None, None, :]
        rel = (slots - (self.lengths[:, None] - 1)).float()  # key position - query position
        bias = slopes.float()[None, :, None] * rel[:, None, :]  # [batch, heads, max]
        bias = bias.masked_fill(~visible[:, None, :], float("-inf"))
        return bias[:, :, None, :].to(dtype)


@dataclass(frozen=True)
class LayerParts:
    """The adopted submodules one decoder layer calls, as plain (unregistered) references: the
    layer registered them under their HF names, so ``state_dict`` names stay HF's. Each is used
    as found — an ``nn.Linear``, a transformers ``Conv1D``, a shardwise quantized linear — and
    called as a module, so its hooks (tensor-parallel all-reduce) run."""

    attn_norm: nn.Module
    mlp_norm: nn.Module | None  # None: one norm feeds attention and MLP (parallel residual)
    qkv: tuple[nn.Module, ...]  # one fused projection, or q, k, v
    out_proj: nn.Module
    mlp_in: tuple[nn.Module, ...]  # gate, up — or one (fused [gate | up], or a plain MLP's)
    mlp_out: nn.Module | None  # None on an MoE layer
    #: the MoE block on an MoE layer (``MoESpec.block``, called as a module: the forward
    #: shardwise.moe installed, or HF's own), else None (the dense MLP above runs)
    moe: nn.Module | None = None
    #: the per-head q and k norms (``Attention.qk_norm``), else None
    qk_norm: tuple[nn.Module, nn.Module] | None = None

    @classmethod
    def of(cls, layer: nn.Module, spec: InjectionSpec, moe: Any = None) -> "LayerParts":
        """The modules ``spec`` names, read from ``layer`` now; ``moe`` (the policy's MoESpec,
        None for a dense family): a layer holding its MoE block calls that instead of an MLP."""
        get, residual = layer.get_submodule, spec.residual
        block = moe_block(layer, moe)
        return cls(attn_norm=get(residual.attn_norm),
                   mlp_norm=get(residual.mlp_norm) if residual.mlp_norm else None,
                   qkv=tuple(get(n) for n in spec.attention.qkv),
                   out_proj=get(spec.attention.out_proj),
                   mlp_in=() if block is not None else tuple(get(n) for n in spec.mlp.in_proj),
                   mlp_out=None if block is not None else get(spec.mlp.out_proj), moe=block,
                   qk_norm=tuple(get(n) for n in spec.attention.qk_norm)
                   if spec.attention.qk_norm else None)


def moe_block(layer: nn.Module, moe: Any) -> nn.Module | None:
    """``layer``'s MoE block (``moe.block`` holding ``moe.experts``), None for a dense layer (a
    family with leading dense layers keeps its MLP at the same name) or a dense family."""
    if moe is None:
        return None
    try:
        block = layer.get_submodule(moe.block)
        block.get_submodule(moe.experts)
    except AttributeError:
        return None
    return block


@dataclass(frozen=True)
class LayerSetup:
    """What one injected layer needs beyond its spec: this rank's head counts, the score scale,
    the sliding window (None: none), this rank's ALiBi slopes ([q_heads] float32, already times
    the scale where the family scales them; None: no ALiBi), the GELU approximation, the
    residual form and this rank's attention-sink logits ([q_heads] float32; None: none)."""

    q_heads: int
    kv_heads: int
    head_dim: int
    scale: float
    window: int | None
    alibi: torch.Tensor | None
    approximate: str
    parallel: bool
    sinks: torch.Tensor | None = None


class InjectedLayer(nn.Module):
    """One decoder layer: fused residual+norm, attention over the static cache, MLP.

    Attributes:
        spec: the family's :class:`InjectionSpec`.
        kernels: the op implementations it calls (:class:`Kernels`).
        parts: the adopted HF submodules it calls (:class:`LayerParts`).
        setup: this rank's head counts, scale, window, ALiBi slopes (:class:`LayerSetup`).
    """

    def __init__(self, hf_layer: nn.Module, spec: InjectionSpec, kernels: Kernels, index: int,
                 setup: LayerSetup, moe: Any = None, slot: int | None = None) -> None:
        super().__init__()
        for name, child in hf_layer.named_children():  # adopt: same names, same parameters
            self.add_module(name, child)
        self.spec, self.kernels, self.index, self.setup = spec, kernels, index, setup
        #: this layer's entry in the static cache: its index, or under pipeline stages its
        #: place within the stage (the cache holds the stage's layers only)
        self.slot = index if slot is None else slot
        self.moe_spec = moe  # the policy's MoESpec (None: a dense family)
        self.head_dim, self.scale = setup.head_dim, setup.scale
        self.q_heads, self.kv_heads = setup.q_heads, setup.kv_heads
        # output features of q, k, v: [q_heads * head_dim, kv_heads * head_dim (twice)]
        self.widths = [self.q_heads * self.head_dim, *[self.kv_heads * self.head_dim] * 2]
        self._bind_adopted()
        self.fused_qkv = len(self.parts.qkv) == 1
        #: how a one-projection q/k/v output is laid out: the spec's, or "blocks" once
        #: :meth:`fuse_projections` fused separate q, k, v
        self.qkv_layout = spec.attention.qkv_layout
        #: the groups :meth:`fuse_projections` fused (:class:`~shardwise.inject.fuse.
        #: FusedProjection`), and the parts as adopted, to go back to
        self.fused_groups: list = []
        self._unfused_parts: LayerParts | None = None
        # multi-head latent attention (DeepSeek): its own attention, over a latent cache
        self.latent_attn = latent_core(self, spec, index)
        width = sum(out_width(proj) for proj in self.parts.qkv)
        if self.latent_attn is None and width != sum(self.widths):
            raise ShardwiseError(f"layer {index}: the q/k/v projections give {width} features, "
                                 f"not {self.q_heads} q + 2 × {self.kv_heads} kv heads of "
                                 f"{self.head_dim}; the policy's head counts do not match the "
                                 f"weights")
        # [q_heads]: moves with the model (not saved: derived from the config)
        self.register_buffer("alibi_slopes", setup.alibi, persistent=False)
        # [q_heads] float32, this rank's sink logits (a copy: the HF parameter stays as is)
        self.register_buffer("attn_sinks", setup.sinks, persistent=False)

    @property
    def attn_kw(self) -> dict[str, Any]:
        """The attention kwargs every kernel call of this layer shares."""
        kw: dict[str, Any] = {"scale": self.scale}
        if self.setup.window is not None:
            kw["window"] = self.setup.window
        if self.alibi_slopes is not None:
            kw["alibi_slopes"] = self.alibi_slopes
        if self.attn_sinks is not None:
            kw["sinks"] = self.attn_sinks
        return kw

    def _bind_adopted(self) -> None:
        """Read the adopted submodules the spec names (:class:`LayerParts`), once: injection
        runs after every transform that swaps modules (quantization), so they are the ones the
        model keeps."""
        self.parts = LayerParts.of(self, self.spec, self.moe_spec)

    def fuse_projections(self) -> list[str]:
        """Run separate q, k, v as one projection and separate gate, up as one (module
        docstring of :mod:`shardwise.inject.fuse`: one copy of the weights, the parts' tensors
        become views of the fused ones, recorded in the active ledger). Latent attention and MoE
        layers keep their projections. Returns what was fused (``"q|k|v"``, ``"gate|up"``)."""
        from .fuse import fuse

        if self.fused_groups or self.latent_attn is not None:
            return []
        parts, changes, done = self.parts, {}, []
        if len(parts.qkv) == 3:
            group = fuse(parts.qkv, "q|k|v")
            if group is not None:
                changes["qkv"] = (group.module,)
                self.fused_groups.append(group)
        if parts.moe is None and self.spec.mlp.kind == "gated" and len(parts.mlp_in) == 2:
            group = fuse(parts.mlp_in, "gate|up")
            if group is not None:
                changes["mlp_in"] = (group.module,)
                self.fused_groups.append(group)
        if changes:
            self._unfused_parts = parts
            self.parts = dataclasses.replace(parts, **changes)
            if "qkv" in changes:
                self.fused_qkv, self.qkv_layout = True, "blocks"
            done = [g.what for g in self.fused_groups]
        return done

    def unfuse_projections(self) -> int:
        """Undo :meth:`fuse_projections`: the parts get their own storage again and the layer
        calls them. Returns the number of groups unfused."""
        groups, self.fused_groups = self.fused_groups, []
        for group in groups:
            group.release()
        if self._unfused_parts is not None:
            self.parts, self._unfused_parts = self._unfused_parts, None
            self.fused_qkv = len(self.parts.qkv) == 1
            self.qkv_layout = self.spec.attention.qkv_layout
        return len(groups)

    def _norm(self, module: nn.Module, x: torch.Tensor, residual: torch.Tensor | None):
        """(norm(x + residual), x + residual) — fused; residual None: norm(x), x."""
        eps = getattr(module, "variance_epsilon", None)
        eps = module.eps if eps is None else eps
        if self.spec.residual.norm == "rms":
            return self.kernels.norm(x, module.weight, eps, residual=residual)
        return self.kernels.norm(x, module.weight, module.bias, eps, residual=residual)

    def forward(self, delta: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext):
        """``delta`` [b, s, hidden]: the previous layer's output, not yet added to the
        ``residual`` stream [b, s, hidden] (None before the first layer) → (this layer's delta,
        the residual stream): each add is fused into the next norm."""
        parts = self.parts
        attn_input, residual = self._norm(parts.attn_norm, delta, residual)
        attn_output = self._attention(attn_input, ctx)  # [b, s, hidden]
        if self.setup.parallel:  # x + attn(n1(x)) + mlp(n2(x)): both read the same stream
            mlp_input = attn_input if parts.mlp_norm is None else \
                self._norm(parts.mlp_norm, residual, None)[0]
            return attn_output + self._mlp(mlp_input), residual
        mlp_input, residual = self._norm(parts.mlp_norm, attn_output, residual)
        return self._mlp(mlp_input), residual

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, hidden] → [b, s, hidden]."""
        if self.parts.moe is not None:  # an MoE layer: its block, called as a module
            out = self.parts.moe(x)
            return out[0] if isinstance(out, tuple) else out  # GPT-OSS: (hidden, router scores)
        mlp_in, mlp_out, act = self.parts.mlp_in, self.parts.mlp_out, self.kernels.act
        if self.spec.mlp.kind == "gated":  # two projections, or one fused [gate | up]
            up = mlp_in[1](x) if len(mlp_in) == 2 else None
            return mlp_out(act(mlp_in[0](x), up))
        if self.setup.approximate:
            return mlp_out(act(mlp_in[0](x), None, self.setup.approximate))
        return mlp_out(act(mlp_in[0](x), None))

    def _qkv(self, x: torch.Tensor):
        """q [b, s, q_heads, d], k and v [b, s, kv_heads, d] from the projection(s) of x
        [b, s, hidden]."""
        b, s, _ = x.shape
        d, hq, hkv = self.head_dim, self.q_heads, self.kv_heads
        qkv = self.parts.qkv
        if not self.fused_qkv:
            q, k, v = (proj(x) for proj in qkv)
        elif self.qkv_layout == "blocks":  # [q | k | v]
            q, k, v = qkv[0](x).split(self.widths, dim=-1)
        else:  # grouped: [kv_heads, q_per_kv + 2, d]
            q_per_kv = hq // hkv
            fused = qkv[0](x).view(b, s, hkv, q_per_kv + 2, d)
            return (fused[..., :q_per_kv, :].reshape(b, s, hq, d), fused[..., q_per_kv, :],
                    fused[..., q_per_kv + 1, :])
        return q.view(b, s, hq, d), k.view(b, s, hkv, d), v.view(b, s, hkv, d)

    def _attention(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """x [b, s, hidden] → the output projection of the attention [b, s, hidden]."""
        if self.latent_attn is not None:
            return self.latent_attn(self, x, ctx)
        b, s, _ = x.shape
        kernels = self.kernels
        q, k, v = self._qkv(x)  # [b, s, heads, d]
        if self.parts.qk_norm is not None:  # per-head norms over head_dim (Qwen3-MoE)
            q = self._norm(self.parts.qk_norm[0], q, None)[0]
            k = self._norm(self.parts.qk_norm[1], k, None)[0]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        if ctx.cos is not None:
            q, k = kernels.rotary(q, k, ctx.cos, ctx.sin, style=self.spec.positions.rotary_style)
        cache, kw = ctx.cache, self.attn_kw
        if ctx.mixed is not None:
            context = self._mixed_attention(q, k, v, ctx)
        elif cache is None:
            context = kernels.attention_prefill(q, k, v, causal=True,
                                                key_padding_mask=ctx.key_padding_mask, **kw)
        else:
            # this layer's cache [batch, kv_heads, max_tokens, d]
            k_cache, v_cache = cache.k[self.slot], cache.v[self.slot]
            if ctx.graph_safe:  # no host sync: each row at its device index
                write_rows(k_cache, ctx.write_index, k)
                write_rows(v_cache, ctx.write_index, v)
                context = self._captured_decode(q, k_cache, v_cache, ctx)
            else:
                kernels.kv_cache_write(k_cache, v_cache, k, v, ctx.write_pos)
                if ctx.decode:
                    context = kernels.attention_decode(q, k_cache, v_cache, ctx.lengths,
                                                       starts=ctx.starts, **kw)
                elif ctx.past == 0:
                    context = kernels.attention_prefill(
                        q, k, v, causal=True, key_padding_mask=ctx.key_padding_mask, **kw)
                else:  # a prompt continued after cached tokens: attend over all of them
                    seen = ctx.past + s
                    context = kernels.attention_prefill(
                        q, k_cache[:, :, :seen], v_cache[:, :, :seen], causal=True,
                        key_padding_mask=ctx.key_padding_mask, **kw)
        # context [b, q_heads, s, d] → [b, s, q_heads * d]
        return self.parts.out_proj(context.transpose(1, 2).reshape(b, s, self.q_heads * self.head_dim))

    def _mixed_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         ctx: StepContext) -> torch.Tensor:
        """Attention of a mixed forward (:class:`~shardwise.inject.cache.MixedRows`): q
        [1, q_heads, T, d], k and v [1, kv_heads, T, d], packed as decode tokens then prompt
        chunks → context [1, q_heads, T, d]. The decode part is one ``attention_decode`` over
        the cache's first ``span`` rows; each chunk one ``attention_prefill`` over its slot's
        row (causal, bottom-right: after its cached tokens), as a prompt chunk alone runs."""
        rows, kernels, kw = ctx.mixed, self.kernels, self.attn_kw
        attend = getattr(rows, "attend", None)
        if attend is not None:  # a captured mixed step's static layout (inject.slots.PackedRows)
            return attend(self, q, k, v, ctx)
        k_cache, v_cache = ctx.cache.k[self.slot], ctx.cache.v[self.slot]
        n = rows.n_decode
        parts = [self._mixed_decode(q[:, :, :n], k[:, :, :n], v[:, :, :n], k_cache, v_cache,
                                    rows)] if n else []
        for slot, past, size in rows.chunks:
            part = slice(n, n + size)
            q_c, k_c, v_c = q[:, :, part], k[:, :, part], v[:, :, part]
            k_row, v_row = k_cache[slot:slot + 1], v_cache[slot:slot + 1]
            kernels.kv_cache_write(k_row, v_row, k_c, v_c, past)
            if past:  # after cached tokens: attend over all of them
                k_c, v_c = k_row[:, :, :past + size], v_row[:, :, :past + size]
            parts.append(kernels.attention_prefill(q_c, k_c, v_c, causal=True, **kw))
            n += size
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]

    def _mixed_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      rows: MixedRows) -> torch.Tensor:
        """The decode part of a mixed forward: q [1, q_heads, n, d], k and v
        [1, kv_heads, n, d] (token i of slot ``rows.slots[i]``) → [1, q_heads, n, d]. The
        tokens are scattered to their rows of the first ``span`` cache rows ([span, heads, 1,
        d]; rows holding no decode token write and read the scratch position), written with
        ``kv_cache_write`` at each row's own position and attended with ``attention_decode``
        over each row's valid range, as in a decode step."""
        span, slots = rows.span, rows.slots

        def by_row(t: torch.Tensor) -> torch.Tensor:  # [1, h, n, d] → [span, h, 1, d]
            out = t.new_zeros(span, t.shape[1], 1, t.shape[3])
            out[slots] = t[0].transpose(0, 1)[:, :, None]
            return out

        k_span, v_span = k_cache[:span], v_cache[:span]
        self.kernels.kv_cache_write(k_span, v_span, by_row(k), by_row(v), rows.write_index)
        out = self.kernels.attention_decode(by_row(q), k_span, v_span, rows.lengths,
                                            starts=rows.starts, **self.attn_kw)
        return out[slots, :, 0].transpose(0, 1)[None]  # [span, hq, 1, d] → [1, hq, n, d]

    def _captured_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         ctx: StepContext) -> torch.Tensor:
        """Decode attention inside a captured step: the capturable kernel (reads only each
        sequence's valid cache range), else SDPA over all ``max_tokens`` slots, masked (with
        attention sinks: the same softmax written out, :func:`masked_sink_attention`)."""
        if self.kernels.decode_capturable:
            return self.kernels.attention_decode(q, k_cache, v_cache, ctx.lengths,
                                                 starts=ctx.starts, **self.attn_kw)
        if self.attn_sinks is not None:
            return masked_sink_attention(q, k_cache, v_cache, ctx.mask_for(self), self.scale,
                                         self.attn_sinks)
        return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=ctx.mask_for(self),
                                              scale=self.scale,
                                              enable_gqa=self.q_heads != self.kv_heads)


def masked_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                          scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with sinks over a whole static cache, host-sync free (the graph-safe step's
    fallback when no capturable decode kernel exists): q [b, q_heads, 1, d], k and v
    [b, kv_heads, max_tokens, d], ``mask`` as :meth:`StepContext.mask_for` gives it (bool
    visible, or a float bias with -inf), sinks [q_heads] → [b, q_heads, 1, d] in q.dtype.
    The reference kernel's math (float32, the sink one more softmax column, dropped)."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [b, q_heads, max_tokens, d]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = q.float() @ kf.transpose(-1, -2) * scale  # [b, q_heads, 1, max_tokens]
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    probs = softmax_with_sinks(scores, sinks)
    return (probs @ vf).to(q.dtype)


def _thread_name(ident: int) -> str:
    """``'name'`` of the live thread ``ident`` (for messages)."""
    return next((repr(t.name) for t in threading.enumerate() if t.ident == ident), f"#{ident}")


class ThreadGuard:
    """Who is using an injected model right now: the thread running a forward, and the thread
    holding a generate session (:meth:`InjectedModel.session`). State changes happen under one
    short lock, so every interleaving of threads is either refused with
    :class:`~shardwise.inject.cache.ConcurrentUseError` or safe. Copies (``deepcopy``, pickling)
    get a fresh guard: locks are per live object."""

    def __init__(self) -> None:
        self.state = threading.Lock()  # held for a few instructions only
        self.session_lock = threading.RLock()  # held for a whole generate; waited on
        self.forward_thread: int | None = None
        self.session_thread: int | None = None
        #: (ident, name) of the thread that started the newest sequence (its cache is live)
        self.cache_thread: tuple[int, str] | None = None

    def __reduce__(self):
        return ThreadGuard, ()

    def enter_forward(self) -> None:
        me = threading.get_ident()
        with self.state:
            holder, busy = self.session_thread, self.forward_thread
            if holder is not None and holder != me:
                raise ConcurrentUseError(
                    f"thread {_thread_name(me)} called the injected model while thread "
                    f"{_thread_name(holder)} is generating on it; {THREADS_HINT}")
            if busy is not None:
                raise ConcurrentUseError(
                    f"thread {_thread_name(me)} called the injected model while thread "
                    f"{_thread_name(busy)} is in the middle of a forward on it; {THREADS_HINT}")
            self.forward_thread = me

    def leave_forward(self) -> None:
        with self.state:
            self.forward_thread = None

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        me = threading.get_ident()
        with self.session_lock:  # another thread's session: wait for it to end
            with self.state:
                busy = self.forward_thread
                if busy is not None and busy != me:
                    raise ConcurrentUseError(
                        f"thread {_thread_name(me)} started a generate while thread "
                        f"{_thread_name(busy)} is in the middle of a forward on the same injected "
                        f"model outside engine.generate; {THREADS_HINT}")
                outer, self.session_thread = self.session_thread, me
            try:
                yield
            finally:
                with self.state:
                    self.session_thread = outer


def _one_thread(forward: Callable) -> Callable:
    """Run ``forward`` under the model's :class:`ThreadGuard` (refused while another thread
    uses the model)."""
    @functools.wraps(forward)
    def guarded(self, *args: Any, **kwargs: Any) -> Any:
        self._guard.enter_forward()
        try:
            return forward(self, *args, **kwargs)
        finally:
            self._guard.leave_forward()
    return guarded


def _optional(base: nn.Module, name: str | None) -> nn.Module | None:
    """``base``'s submodule ``name`` (None when the spec names none or the model has it unset)."""
    if not name:
        return None
    parent, _, attr = name.rpartition(".")
    return getattr(base.get_submodule(parent) if parent else base, attr, None)


@dataclass(frozen=True)
class StackParts:
    """The adopted submodules the stack's forward calls outside the layers, as plain
    references (see :class:`LayerParts`); None where the family or the model has none."""

    layers: nn.ModuleList  # the InjectedLayers
    embed: nn.Module | None
    final_norm: nn.Module
    pos_embed: nn.Module | None  # learned positions
    rotary: nn.Module | None  # the model's own rotary table module
    embed_norm: nn.Module | None
    project_in: nn.Module | None
    project_out: nn.Module | None

    @classmethod
    def of(cls, base: nn.Module, spec: InjectionSpec, layers: nn.ModuleList) -> "StackParts":
        """The modules ``spec`` names, read from ``base`` (the stack) now."""
        positions, residual = spec.positions, spec.residual
        return cls(layers=layers, embed=_optional(base, spec.embed),
                   final_norm=base.get_submodule(residual.final_norm),
                   pos_embed=_optional(base, positions.embed),
                   rotary=_optional(base, positions.rotary_module),
                   embed_norm=_optional(base, residual.embed_norm),
                   project_in=_optional(base, spec.project_in),
                   project_out=_optional(base, spec.project_out))


def stage_of(hf_layers: nn.ModuleList) -> Any:
    """The pipeline stage a decoder layer list belongs to: the
    :class:`~shardwise.pipeline.transform.StageLink` its stand-ins for other stages' layers
    (:class:`~shardwise.pipeline.RemoteLayer`) carry; None for a whole model (no stand-in)."""
    from ..pipeline.transform import RemoteLayer

    return next((layer.link for layer in hf_layers if isinstance(layer, RemoteLayer)), None)


class InjectedModel(nn.Module):
    """The decoder stack that replaces the HF base model (see the module docstring).

    Under pipeline stages (the layer list holds stand-ins for other stages' layers:
    :func:`stage_of`), the stack runs this stage's layers only — the stand-ins stay in the list
    as they are, holding nothing —, between the receive of the previous stage's hidden states
    and the send to the next (:attr:`stage`, a
    :class:`~shardwise.pipeline.transform.StageLink`); its static cache holds this stage's
    layers while its length counts every token (positions are the whole sequence's)."""

    def __init__(self, hf_base: nn.Module, spec: InjectionSpec, kernels: Kernels,
                 max_tokens: int, setups: list[LayerSetup | None], rotary_dim: int | None,
                 moe: Any = None) -> None:
        super().__init__()
        self.config = hf_base.config
        self.spec, self.kernels, self.max_tokens = spec, kernels, max_tokens
        self.rotary_dim = rotary_dim  # own rotary table (no rotary module): dims rotated per head
        hf_layers = hf_base.get_submodule(spec.layers)
        #: the pipeline stage this stack runs (None: every layer, no stages)
        self.stage = stage_of(hf_layers)
        first = self.stage.layers.start if self.stage is not None else 0
        #: what the shell reads: an MoE family's shell also reads ``router_logits`` (None here)
        self.output_type = StackOutput if moe is None else MoeModelOutputWithPast
        layers = nn.ModuleList(
            layer if setup is None else  # another stage's: its stand-in, as it is
            InjectedLayer(layer, spec, kernels, i, setup, moe,
                          slot=None if self.stage is None else i - first)
            for i, (layer, setup) in enumerate(zip(hf_layers, setups)))
        for name, child in hf_base.named_children():  # same names, same order
            self.add_module(name, layers if child is hf_layers else child)
        self._layers = [layers]  # unregistered handle (the ModuleList is registered above)
        #: the layers this rank runs, in order (all of them without stages), unregistered
        self._own = [layer for layer in layers if isinstance(layer, InjectedLayer)]
        self._bind_adopted()
        self.kv_heads = self._own[0].kv_heads if self._own else 0
        self.head_dim = self._own[0].head_dim if self._own else 0
        self._kv: dict[int, KVBuffers] = {}  # rows (batch, or its bucket) → buffers
        self._cache_generation = 0
        self.graphs: Any = None  # a DecodeGraphs when graph capture is on
        self._guard = ThreadGuard()
        #: the accelerator's ``free_memory(index)`` (set by inject_model): each cache
        #: allocation is checked against it first
        self.free_memory: Callable[[int], int] | None = None

    @property
    def _cache_thread(self) -> tuple[int, str] | None:
        """(ident, name) of the thread that started the newest sequence."""
        return self._guard.cache_thread

    def session(self) -> contextlib.AbstractContextManager:
        """A context that holds this model's static cache for one whole ``generate`` in this
        thread: another thread's session waits until it ends (``engine.generate`` runs in
        one, so engine calls from several threads are serialized), and another thread's bare
        forward meanwhile raises :class:`~shardwise.inject.cache.ConcurrentUseError` instead of
        overwriting the cache. Re-entrant."""
        return self._guard.session()

    def _bind_adopted(self) -> None:
        """Read the adopted submodules the forward calls, once (:class:`StackParts`; see
        :meth:`InjectedLayer._bind_adopted`)."""
        self.parts = StackParts.of(self, self.spec, self._layers[0])

    def fuse_projections(self) -> dict[str, int]:
        """Fuse q|k|v and gate|up in every layer this rank runs
        (:meth:`InjectedLayer.fuse_projections`). Returns ``{"q|k|v": n, "gate|up": m}``, the
        layers that run each fused group (:func:`~shardwise.inject.fuse.fusion_report`)."""
        from .fuse import fusion_report

        for layer in self._own:
            layer.fuse_projections()
        return fusion_report(self)

    def unfuse_projections(self) -> int:
        """Undo :meth:`fuse_projections` in every layer (the parts get their own storage again);
        returns the number of groups unfused. A captured step captured the fused modules: call
        this before capture (the offload step does), not after."""
        return sum(layer.unfuse_projections() for layer in self._own)

    # HF helpers the shell delegates to its base model
    def get_input_embeddings(self) -> nn.Module:
        return self.parts.embed

    def set_input_embeddings(self, value: nn.Module) -> None:
        raise ShardwiseError("the input embeddings of an injected model cannot be replaced")

    # ----- the cache -----------------------------------------------------------------------------

    def free_cache(self) -> None:
        """Free the static KV buffers and the captured decode graphs (``engine.close()``); a
        cache object still held elsewhere is retired. A later forward allocates afresh."""
        if self.graphs is not None:
            self.graphs.clear()
        for kv in self._kv.values():
            kv.release()
        self._kv.clear()
        self.retire_cache()

    def retire_cache(self) -> None:
        """Retire the live cache object (using it again is a ``StaleCacheError``); the buffers
        stay for the next sequence."""
        self._cache_generation += 1

    def new_cache(self, batch: int, dtype: torch.dtype, device: torch.device) -> StaticKVCache:
        """A fresh cache (retiring the previous one) over buffers for ``batch`` sequences.

        Buffers are allocated once per row count and reused: ``batch`` rows, or with graphs
        the graph strategy's batch bucket (the graph of that bucket serves the batch, padded).
        The buffers of another row count are kept while a captured decode graph uses them (so
        alternating batch sizes replays their graphs instead of capturing again), and freed
        otherwise; a new dtype or device frees them all, graphs included."""
        rows = self.graphs.strategy.batch_bucket(batch) if self.graphs is not None else batch
        kv = self._kv.get(rows)
        if kv is not None and not kv.matches(rows, dtype, device):
            self._kv.clear()
            if self.graphs is not None:
                self.graphs.clear()
            kv = None
        captured = self.graphs.buckets() if self.graphs is not None else set()
        for other in [n for n in self._kv if n != rows and n not in captured]:
            del self._kv[other]
        if kv is None:
            kv = self._kv[rows] = self._allocate(rows, dtype, device)
        self._cache_generation += 1
        self._guard.cache_thread = (threading.get_ident(), threading.current_thread().name)
        return StaticKVCache(kv, self, self._cache_generation, batch)

    def _allocate(self, rows: int, dtype: torch.dtype, device: torch.device,
                  positions: int | None = None) -> KVBuffers:
        """New buffers for ``rows`` sequences of ``positions`` cache positions (default
        ``max_tokens``), checked against the device's free memory first (an allocator failure
        is reported the same way)."""
        tensors = self.spec.attention.cache_tensors  # 1: a latent cache (keys = values)
        positions = self.max_tokens if positions is None else positions
        need = kv_cache_bytes(len(self._own), rows, self.kv_heads, positions,
                              self.head_dim, dtype, tensors=tensors)
        free = free_memory_of(self.free_memory, device)
        where = f"device {device}"
        if free is not None:
            check_kv_fits(need, free, batch=rows, max_tokens=positions, where=where)
        try:
            return KVBuffers(len(self._own), rows, self.kv_heads, positions,
                             self.head_dim, dtype, device, values=tensors == 2)
        except (torch.OutOfMemoryError, RuntimeError) as exc:
            if not isinstance(exc, torch.OutOfMemoryError) and "alloc" not in str(exc).lower():
                raise
            raise kv_memory_error(need, free_memory_of(self.free_memory, device), batch=rows,
                                  max_tokens=positions, where=where, refused=True) from exc

    def _cache_for(self, past: Any, batch: int, x: torch.Tensor,
                   use_cache: bool) -> StaticKVCache | None:
        if isinstance(past, StaticKVCache):
            past.check_live()
            if past.batch != batch:
                raise ShardwiseError(f"the cache holds {past.batch} sequences but the "
                                     f"input has {batch}")
            return past
        if past is not None and past.get_seq_length() > 0:
            raise ShardwiseError(f"an injected model runs with its own static KV cache; got a "
                                 f"{type(past).__name__} that already holds tokens")
        return self.new_cache(batch, x.dtype, x.device) if use_cache else None

    # ----- forward -----------------------------------------------------------------------------

    @_one_thread
    def forward(self, input_ids: torch.Tensor | None = None, past_key_values: Any = None,
                attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                output_attentions: bool | None = None, output_hidden_states: bool | None = None,
                encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None,
                cache: Any = None, **kwargs: Any) -> StackOutput:
        """What HF's base model forward takes (input_ids [b, s] or inputs_embeds [b, s, hidden],
        a 2-d [b, past + s] attention mask, position_ids [b, s]; the cache as
        ``past_key_values`` or, as transformers ≥ 5.2x names it, ``cache``) →
        ``last_hidden_state`` [b, s, hidden] and the static cache as ``past_key_values``."""
        if cache is not None:
            if past_key_values is not None:
                raise ValueError("pass the cache as one of past_key_values or cache, not both")
            past_key_values = cache
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
        dtype = self.parts.final_norm.weight.dtype
        cache = self._cache_for(past_key_values, b, self.parts.final_norm.weight, use_cache)
        past = cache.length if cache is not None else 0
        write_pos = cache.reserve(s) if cache is not None else 0
        if cache is not None and cache.mixed is not None:
            x = self.parts.embed(input_ids) if inputs_embeds is None else inputs_embeds.to(dtype)
            types = None if token_type_ids is None else self.parts.embed(token_type_ids)
            return self._output(self._forward_mixed(cache, x, types), cache)
        decode = cache is not None and s == 1 and (past > 0 or cache.ragged)
        position_ids = self._position_ids(position_ids, attention_mask, past, b, s, ref.device)
        # token embeddings [b, s, hidden]; GPT-2's token types use the same table
        types = None if token_type_ids is None else self.parts.embed(token_type_ids.expand(b, s))
        if decode:
            rows = cache.decode_rows(position_ids)
            if self.graphs is not None and input_ids is not None and types is None \
                    and cache.graph_key is not None:
                hidden = self.graphs.run(self, cache, input_ids, rows)
            else:
                x = self.parts.embed(input_ids) if inputs_embeds is None else \
                    inputs_embeds.to(dtype)
                hidden = self.decode_eagerly(cache, x, rows, types)
            cache.advance(1)
            return self._output(hidden, cache)
        ctx = StepContext(cache, past, decode, write_pos=write_pos)
        self._padding(ctx, attention_mask, cache, past, s)
        x = self.parts.embed(input_ids) if inputs_embeds is None else inputs_embeds.to(dtype)
        x = self._embedded(ctx, x, position_ids, types)
        hidden = self.run_layers(x, ctx)
        if cache is not None:
            cache.advance(s)
        return self._output(hidden, cache)

    def _output(self, hidden: torch.Tensor, cache: StaticKVCache | None):
        """The forward's output: ``last_hidden_state`` and the cache under the name the
        installed transformers gives it (``cache`` from 5.2x, else ``past_key_values``)."""
        name = "cache" if "cache" in self.output_type.__dataclass_fields__ else "past_key_values"
        return self.output_type(last_hidden_state=hidden, **{name: cache})

    @property
    def mixed_unsupported(self) -> str | None:
        """Why this stack cannot run mixed forwards (decode tokens and prompt chunks in one
        forward, :class:`~shardwise.inject.cache.MixedRows`); None when it can."""
        if self.stage is not None:
            return "pipeline stages (each stage's step is sent on as a whole batch)"
        if any(layer.latent_attn is not None for layer in self._own):
            return "multi-head latent attention (its latent cache has its own attention path)"
        return None

    def _forward_mixed(self, cache: StaticKVCache, x: torch.Tensor,
                       types: torch.Tensor | None) -> torch.Tensor:
        """A mixed forward, eager: token embeddings ``x`` [1, T, hidden] packed as
        ``cache.mixed`` says → hidden [1, T, hidden]. Its positions are ``cache.mixed``'s."""
        reason = self.mixed_unsupported
        if reason is not None:
            raise ShardwiseError(f"this injected model cannot run mixed steps: {reason}; "
                                 f"prefill and decode in separate forwards")
        replay = getattr(cache, "replay", None)
        if replay is not None:  # its captured step (inject.slots.SlotMixed)
            if types is not None:  # the captured step takes no token types: never silently
                raise ShardwiseError("a captured mixed step takes no token_type_ids; run the "
                                     "mixed step eagerly (SlotRunner(mixed_buckets=()))")
            return replay(self, x)
        rows = cache.mixed
        ctx = StepContext(cache, past=-1, decode=False, mixed=rows)
        return self.run_layers(self._embedded(ctx, x, rows.position_ids, types), ctx)

    def decode_eagerly(self, cache: StaticKVCache, x: torch.Tensor, rows: DecodeRows,
                       types: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step run op by op: token embeddings ``x`` [b, 1, hidden], the per-row
        positions, write index, lengths and starts ``rows`` → hidden [b, 1, hidden]."""
        ctx = StepContext(cache, cache.length, True, write_pos=rows.write_index,
                          lengths=rows.lengths, starts=rows.starts)
        return self.run_layers(self._embedded(ctx, x, rows.position_ids, types), ctx)

    def _position_ids(self, position_ids: torch.Tensor | None, mask: torch.Tensor | None,
                      past: int, b: int, s: int, device: torch.device) -> torch.Tensor:
        """[b, s] positions: given, else counted from each sequence's first real token
        (``Positions.from_mask``, as OPT), else ``past + arange(s)``."""
        if position_ids is None and mask is not None and self.spec.positions.from_mask:
            mask = mask[:, :past + s].long()
            position_ids = (mask.cumsum(-1) * mask - 1)[:, past:]
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=device)[None]
        return position_ids.expand(b, s)

    def run_layers(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The first layer's input x [b, s, hidden] → the final norm's output (projected out
        where the family has one) [b, s, hidden]."""
        if self.stage is not None:
            return self._run_stage(x, ctx)
        delta, residual = x, None
        for layer in self.parts.layers:
            delta, residual = layer(delta, residual, ctx)
        hidden = self._final_norm(delta, residual)
        return hidden if self.parts.project_out is None else self.parts.project_out(hidden)

    def _run_stage(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """:meth:`run_layers` of one pipeline stage: x [b, s, hidden] (this rank's embedding
        output; off the first stage only its shape counts) → the previous stage's hidden states
        received → this stage's layers → sent on as ``delta + residual`` [b, s, hidden] (the
        next stage's first layer takes them as its input, the residual stream starting there,
        exactly as after the add its norm would fuse). The last stage applies the final norm
        (its output goes to the head, whose hook broadcasts the logits); the others return
        what they sent (the head there is a stand-in that only reads the shape)."""
        stage = self.stage
        hidden = self._stage_layers(stage.receive(x), ctx)
        stage.send(hidden)  # from the last stage nothing: its clock stops
        return hidden

    def _stage_layers(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """This stage's compute, no communication (what a graph captures): its input x
        [b, s, hidden] → its layers → ``delta + residual`` [b, s, hidden] off the last stage,
        the final norm's output (projected out where the family has one) on it."""
        delta, residual = x, None
        for layer in self._own:
            delta, residual = layer(delta, residual, ctx)
        if not self.stage.plan.last:
            return delta if residual is None else delta + residual
        hidden = self._final_norm(delta, residual)
        return hidden if self.parts.project_out is None else self.parts.project_out(hidden)

    def _final_norm(self, delta: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """final_norm(delta + residual) [b, s, hidden], the add fused as in the layers."""
        return self._own[0]._norm(self.parts.final_norm, delta, residual)[0] if len(
            self._own) else self.parts.final_norm(delta)

    def _embedded(self, ctx: StepContext, x: torch.Tensor, position_ids: torch.Tensor,
                  types: torch.Tensor | None = None) -> torch.Tensor:
        """The first layer's input from the token embeddings ``x`` [b, s, hidden]: projected in,
        positions added (learned) or their rotary tables put in ``ctx``, token-type embeddings
        ``types`` added (GPT-2), normed (BLOOM)."""
        if self.parts.project_in is not None:
            x = self.parts.project_in(x)
        positions = self.spec.positions
        if positions.kind == "learned":
            table = self.parts.pos_embed.weight  # [max positions, hidden]
            x = x + F.embedding(position_ids + positions.offset, table).to(x.dtype)
        elif positions.kind == "rotary":
            ctx.cos, ctx.sin = self._rotary_table(position_ids)
        if types is not None:
            x = x + types
        return x if self.parts.embed_norm is None else self.parts.embed_norm(x)

    def _rotary_table(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [b, s, rotary_dim // 2] float32 for the rotary kernel."""
        if self.parts.rotary is None:  # no HF rotary module (GPT-J): the plain table
            return rotary_cos_sin(position_ids, self.rotary_dim, self.spec.positions.rotary_base)
        probe = torch.empty(0, dtype=torch.float32, device=position_ids.device)
        cos, sin = self.parts.rotary(probe, position_ids)  # HF's own table: rope scaling included
        if self.spec.positions.rotary_half_table:  # each frequency once already (GPT-OSS)
            return cos, sin
        half = cos.shape[-1] // 2  # contiguous: the halves are read by every layer's kernel
        return cos[..., :half].contiguous(), sin[..., :half].contiguous()

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
                    lengths: torch.Tensor, starts: torch.Tensor,
                    incoming: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step with static shapes and no host sync (what graph strategies capture):
        input_ids/position_ids [batch, 1], write_index/lengths/starts [batch] → hidden
        [batch, 1, hidden] after the final norm. Under pipeline stages the step holds this
        stage's compute only (:meth:`_stage_layers`; the receive and send stay outside, with
        the caller): ``incoming`` [batch, 1, hidden] is the previous stage's output (unused on
        the first stage), and off the last stage the result is what is sent on."""
        ctx = StepContext(cache, past=-1, decode=True, graph_safe=True, write_index=write_index,
                          lengths=lengths, starts=starts)
        x = self._embedded(ctx, self.parts.embed(input_ids), position_ids)
        if self.stage is None:
            return self.run_layers(x, ctx)
        return self._stage_layers(x if self.stage.plan.first else incoming, ctx)


def generation_session(model: nn.Module) -> contextlib.AbstractContextManager:
    """The generate session (:meth:`InjectedModel.session`) of the injected decoder stack in
    ``model``; a no-op context when it has none."""
    stack = next((m for m in model.modules() if isinstance(m, InjectedModel)), None)
    return stack.session() if stack is not None else contextlib.nullcontext()
