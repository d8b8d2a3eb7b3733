"""Multi-head latent attention (MLA: DeepSeek-V2/V3) in the injected decoder layer.

A policy whose ``InjectionSpec.attention`` is a :class:`~shardwise.inject.spec.LatentAttention`
gets a :class:`LatentAttentionCore` on each injected layer, which runs the layer's attention.
What HF's ``DeepseekV3Attention`` computes (H = this rank's heads; widths read from the weights:
L = the latent (``kv_lora_rank``), N / R = a head's key part without / with rotary positions
(``qk_nope_head_dim`` / ``qk_rope_head_dim``), V = a head's value (``v_head_dim``))::

    q       = q_b(q_a_norm(q_a(x)))  or  q_proj(x)     [b, s, H, N + R] = [q_nope | q_rot]
    kv_a(x) = [c | k_rot]                               [b, s, L + R]; k_rot: one for all heads
    c       = kv_a_norm(c)                              the latent: one per token
    kv_b(c) = [k_nope | v] per head                     [b, s, H, N + V]
    out     = o_proj(softmax([q_nope | rope(q_rot)] · [k_nope | rope(k_rot)] * scaling) v)

Rotary positions: the model's own table (rope scaling and YaRN's attention factor included) on
the R dims, in ``Positions.rotary_style``: "interleaved" pairs (2i, 2i + 1) (HF's
``rope_interleave``, DeepSeek's default) or "half". HF writes the rotated pairs de-interleaved,
the kernel keeps them in place: q and k get the same permutation, so every score is the same.

**The KV cache holds the latent**, not per-head keys and values: one tensor per layer,
``[batch, 1, max_tokens, L + R]`` = ``[c | rope(k_rot)]`` of each token
(``LatentAttention.cache_tensors`` is 1; the layer's ``LayerSetup`` says 1 kv head of L + R).
Why: per token and layer that is L + R values instead of H (N + R + V) — DeepSeek-V3: 576
instead of 40,960, 71× less memory and 71× less to read per decode step — and it is what HF's
own cache holds.
Under tensor parallelism each rank keeps its heads of the queries, ``kv_b_proj`` and ``o_proj``
(or all of them, when the plan leaves the attention whole: the widths are read from the
weights) and the whole latent.

**Prompt (prefill)**: as HF. ``kv_b_proj`` (called as a module, so quantized or head-sharded
linears and their hooks work) expands the latents of the prompt — and of the cached tokens
before it when a prompt continues after cached ones — into per-head keys and values; the
attention kernels, which take one width for k and v, run on q, k (N + R) and v (V) zero-padded
to the wider of the two (the padding's output columns are sliced off). For long prompts,
compute-bound, this is the cheaper form.

**Decode** (one new token, eagerly and in the captured step): absorbed, as DeepSeek's own
inference does. ``q_nope · (W_UK c) = (W_UK^T q_nope) · c``, so the query becomes
``q' = [W_UK^T q_nope | rope(q_rot)]`` [b, H, 1, L + R] and attends over the latent cache as
multi-query attention with one kv head, the cache being both the keys and the values: the
context's first L dims are ``Σ p c`` (its last R, ``Σ p k_rot``, are dropped) and head h's
output is ``W_UV[h] · Σ p c``. Nothing per head is materialised for the cached tokens: a step
reads each cached token's L + R values once, for every head. ``W_UK`` [H, N, L] and ``W_UV``
[H, V, L] are read once, at injection, by calling ``kv_b_proj`` on the identity (one path for a
float, quantized or head-sharded linear, unaffected when graph capture later lays its weight
out for its GEMMs) and kept as non-persistent buffers: one copy of ``kv_b_proj``'s weight in
the model's dtype (DeepSeek-V3: 9% of a layer's attention weights, 0.15% of an MoE layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .cache import write_rows
from .spec import LatentAttention

if TYPE_CHECKING:  # the layer imports this module
    from .layers import InjectedLayer, StepContext


class LatentAttentionError(ConfigError):
    """A model's latent attention does not match its policy's :class:`LatentAttention` (a
    module missing, widths that do not fit the head count, a bias on ``kv_b_proj``)."""


def _width(module: nn.Module, side: str) -> int:
    """A linear's ``"out"`` or ``"in"`` features (``nn.Linear``, or a module with
    ``out_features``/``in_features``: quantized)."""
    if isinstance(module, nn.Linear):
        return module.weight.shape[0 if side == "out" else 1]
    width = getattr(module, f"{side}_features", None)
    if isinstance(width, int):
        return width
    raise LatentAttentionError(f"cannot read the {side}put width of {type(module).__name__}")


def _optional(layer: nn.Module, name: str | None) -> nn.Module | None:
    """``layer``'s submodule ``name``; None when the spec names none or the layer holds None
    there (DeepSeek sets ``q_proj = None`` when it has query LoRA, and the LoRA parts None
    when it has not)."""
    if not name:
        return None
    parent, _, attr = name.rpartition(".")
    module = getattr(layer.get_submodule(parent) if parent else layer, attr, None)
    return module if isinstance(module, nn.Module) else None


def latent_cache_width(hf_layers: nn.ModuleList, attention: LatentAttention) -> int:
    """L + R, the width of one token's cache entry (the latent and the shared rotary key), after
    checking every HF decoder layer's modules and widths against ``attention`` (shapes only: at
    ``init_inference``'s checks, before anything changes).

    Raises:
        LatentAttentionError: a module is missing, the widths do not fit, the layers differ.
    """
    widths = set()
    for index, layer in enumerate(hf_layers):
        parts = LatentParts.of(layer, attention, index)
        dims = LatentDims.of(parts, index)
        if getattr(parts.kv_b, "bias", None) is not None:
            raise LatentAttentionError(
                f"layer {index}: latent attention's kv_b_proj has a bias, which the absorbed "
                f"decode does not implement; run without replace_with_kernel_inject")
        parent = attention.out_proj.rpartition(".")[0]
        if attention.scale is None and getattr(layer.get_submodule(parent) if parent else layer,
                                               "scaling", None) is None:
            raise LatentAttentionError(
                f"layer {index}: latent attention's score scale is not head_dim ** -0.5 of one "
                f"head width; the attention module has no 'scaling' to read it from: give "
                f"LatentAttention(scale=...)")
        widths.add(dims.latent + dims.rope)
    if len(widths) > 1:
        raise LatentAttentionError(f"the layers' latent attention caches differ in width "
                                   f"({sorted(widths)}); one static cache needs one width")
    return widths.pop() if widths else 0


@dataclass(frozen=True)
class LatentParts:
    """The adopted submodules latent attention calls, as plain (unregistered) references (see
    :class:`~shardwise.inject.layers.LayerParts`): ``q_proj``, or the query LoRA ``q_a`` →
    ``q_a_norm`` → ``q_b``."""

    q_proj: nn.Module | None
    q_a: nn.Module | None
    q_a_norm: nn.Module | None
    q_b: nn.Module | None
    kv_a: nn.Module
    kv_a_norm: nn.Module
    kv_b: nn.Module
    out_proj: nn.Module

    @classmethod
    def of(cls, layer: nn.Module, attention: LatentAttention, index: int) -> "LatentParts":
        """The modules ``attention`` names, read from ``layer`` now."""
        def get(name: str) -> nn.Module:
            try:
                return layer.get_submodule(name)
            except AttributeError:
                raise LatentAttentionError(f"layer {index} has no module {name!r} (its policy's "
                                           f"LatentAttention names it)") from None

        parts = cls(q_proj=_optional(layer, attention.q_proj),
                    q_a=_optional(layer, attention.q_a_proj),
                    q_a_norm=_optional(layer, attention.q_a_norm),
                    q_b=_optional(layer, attention.q_b_proj),
                    kv_a=get(attention.kv_a_proj), kv_a_norm=get(attention.kv_a_norm),
                    kv_b=get(attention.kv_b_proj), out_proj=get(attention.out_proj))
        if parts.q_proj is None and None in (parts.q_a, parts.q_a_norm, parts.q_b):
            raise LatentAttentionError(
                f"layer {index}: latent attention finds neither q_proj ({attention.q_proj!r}) "
                f"nor the query LoRA ({attention.q_a_proj!r}, {attention.q_a_norm!r}, "
                f"{attention.q_b_proj!r})")
        return parts

    @property
    def query(self) -> nn.Module:
        """The projection that gives the per-head queries (``q_proj`` or LoRA's ``q_b``)."""
        return self.q_proj if self.q_proj is not None else self.q_b


@dataclass(frozen=True)
class LatentDims:
    """This rank's widths of latent attention (see the module docstring): ``heads`` H,
    ``latent`` L, ``nope`` N, ``rope`` R, ``value`` V."""

    heads: int
    latent: int
    nope: int
    rope: int
    value: int

    @classmethod
    def of(cls, parts: LatentParts, index: int) -> "LatentDims":
        """Read from the weights' shapes alone, so they hold whether tensor parallelism split
        the heads (this rank's) or left the attention whole (all of them): with the query width
        H (N + R), kv_b_proj's H (N + V) and o_proj's input H V, the rotary part R (kv_a_proj's
        width less the latent's, kv_a_norm's) gives H = (H (N + R) - H (N + V) + H V) / R. Each
        width is checked, so a policy naming the wrong module fails here."""
        latent = parts.kv_a_norm.weight.shape[-1]
        rope = _width(parts.kv_a, "out") - latent
        q_width, kv_width = _width(parts.query, "out"), _width(parts.kv_b, "out")
        o_width = _width(parts.out_proj, "in")
        head_rope = q_width - kv_width + o_width  # H R
        heads = head_rope // rope if rope > 0 and head_rope > 0 and head_rope % rope == 0 else 0
        if heads < 1 or rope % 2 or q_width % heads or o_width % heads:
            raise LatentAttentionError(
                f"layer {index}: latent attention's widths fit no head count: kv_a_proj gives "
                f"{latent + rope} = latent {latent} (kv_a_norm) + rotary {rope} (even, > 0), the "
                f"queries {q_width} = H (nope + rotary), kv_b_proj {kv_width} = H (nope + v), "
                f"o_proj's input {o_width} = H v; the policy's names do not match the weights")
        nope, value = q_width // heads - rope, o_width // heads
        if nope < 1 or kv_width != heads * (nope + value):
            raise LatentAttentionError(
                f"layer {index}: latent attention reads {heads} heads with a key part of {nope} "
                f"from the queries, which kv_b_proj's {kv_width} features do not fit; the "
                f"policy's names do not match the weights")
        return cls(heads, latent, nope, rope, value)


def absorbed_weights(kv_b: nn.Module, dims: LatentDims, dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [H, N, L], W_UV^T [H, L, V]) of ``kv_b`` (latent → per head [k_nope | v]),
    read by calling it on the identity [L, L]: row i of the result is column i of its weight,
    whatever kind of linear it is (a bias is refused earlier: :func:`latent_cache_width`)."""
    h, n, v, latent = dims.heads, dims.nope, dims.value, dims.latent
    with torch.inference_mode(False), torch.no_grad():  # buffers, not inference tensors
        eye = torch.eye(latent, dtype=dtype, device=device)
        w_t = kv_b(eye).view(latent, h, n + v)  # [L, H, N + V] = weight^T
        w_uk = w_t[..., :n].permute(1, 2, 0).contiguous()  # [H, N, L]
        w_uv_t = w_t[..., n:].transpose(0, 1).contiguous()  # [H, L, V]
    return w_uk, w_uv_t


class LatentAttentionCore(nn.Module):
    """The attention of one injected layer with multi-head latent attention (see the module
    docstring). Registered on the layer (its buffers move with the model), holding no
    parameters: the projections stay the adopted HF modules, called as modules.

    Buffers (non-persistent: not in ``state_dict``): ``w_uk`` [H, N, L] and ``w_uv_t``
    [H, L, V], the absorbed halves of ``kv_b_proj``.
    """

    def __init__(self, layer: nn.Module, attention: LatentAttention, index: int) -> None:
        super().__init__()
        self.parts = LatentParts.of(layer, attention, index)
        self.dims = LatentDims.of(self.parts, index)
        weight = self.parts.kv_a_norm.weight
        w_uk, w_uv_t = absorbed_weights(self.parts.kv_b, self.dims, weight.dtype, weight.device)
        self.register_buffer("w_uk", w_uk, persistent=False)
        self.register_buffer("w_uv_t", w_uv_t, persistent=False)

    def extra_repr(self) -> str:
        d = self.dims
        return (f"heads={d.heads}, latent={d.latent}, nope={d.nope}, rope={d.rope}, "
                f"value={d.value}")

    def forward(self, layer: "InjectedLayer", x: torch.Tensor,
                ctx: "StepContext") -> torch.Tensor:
        """x [b, s, hidden] (the attention norm's output) → the output projection [b, s,
        hidden]; writes this layer's cache entries when ``ctx`` has a cache."""
        b, s, _ = x.shape
        q_nope, q_rot = self._queries(layer, x)  # [b, H, s, N], [b, H, s, R]
        latent, k_rot = self._latent(layer, x)  # [b, 1, s, L], [b, 1, s, R]
        if ctx.cos is not None:
            q_rot, k_rot = layer.kernels.rotary(q_rot, k_rot, ctx.cos, ctx.sin,
                                                style=layer.spec.positions.rotary_style)
        if ctx.cache is not None and ctx.decode:
            context = self._decode(layer, q_nope, q_rot, torch.cat([latent, k_rot], -1), ctx)
        else:
            context = self._prefill(layer, q_nope, q_rot, latent, k_rot, ctx)
        # context [b, H, s, V] → [b, s, H * V]
        return self.parts.out_proj(context.transpose(1, 2).reshape(b, s, -1))

    def _queries(self, layer: "InjectedLayer", x: torch.Tensor):
        """(q_nope [b, H, s, N], q_rot [b, H, s, R]) of x [b, s, hidden]."""
        parts, d = self.parts, self.dims
        if parts.q_proj is not None:
            q = parts.q_proj(x)
        else:
            q = parts.q_b(layer._norm(parts.q_a_norm, parts.q_a(x), None)[0])
        q = q.view(*x.shape[:2], d.heads, d.nope + d.rope).transpose(1, 2)
        return q[..., :d.nope], q[..., d.nope:]

    def _latent(self, layer: "InjectedLayer", x: torch.Tensor):
        """(the normed latent [b, 1, s, L], the rotary key before rotation [b, 1, s, R]) of x."""
        d = self.dims
        compressed = self.parts.kv_a(x)  # [b, s, L + R]
        latent = layer._norm(self.parts.kv_a_norm, compressed[..., :d.latent], None)[0]
        return latent[:, None], compressed[:, None, :, d.latent:]

    def _prefill(self, layer: "InjectedLayer", q_nope: torch.Tensor, q_rot: torch.Tensor,
                 latent: torch.Tensor, k_rot: torch.Tensor, ctx: "StepContext") -> torch.Tensor:
        """A prompt (or a prompt chunk after cached tokens), expanded per head as HF: the
        context [b, H, s, V]. Writes the prompt's cache entries first."""
        d, cache = self.dims, ctx.cache
        if cache is not None:
            entry = cache.k[layer.slot]  # [batch, 1, max_tokens, L + R]
            entry[:, :, ctx.write_pos:ctx.write_pos + latent.shape[2]] = torch.cat(
                [latent, k_rot], -1)
            if ctx.past > 0:  # attend over the cached tokens too: their latents, expanded
                seen = entry[:, :, :ctx.past + latent.shape[2]]
                latent, k_rot = seen[..., :d.latent], seen[..., d.latent:]
        b, _, t, _ = latent.shape
        kv = self.parts.kv_b(latent[:, 0]).view(b, t, d.heads, d.nope + d.value).transpose(1, 2)
        q = torch.cat([q_nope, q_rot], -1)  # [b, H, s, N + R]
        k = torch.cat([kv[..., :d.nope], k_rot.expand(b, d.heads, t, d.rope)], -1)
        v = kv[..., d.nope:]  # [b, H, t, V]
        width = max(d.nope + d.rope, d.value)  # the kernels take k and v of one width
        q, k, v = (F.pad(u, (0, width - u.shape[-1])) if u.shape[-1] < width else u
                   for u in (q, k, v))
        context = layer.kernels.attention_prefill(q, k, v, causal=True,
                                                  key_padding_mask=ctx.key_padding_mask,
                                                  **layer.attn_kw)
        return context[..., :d.value]

    def _decode(self, layer: "InjectedLayer", q_nope: torch.Tensor, q_rot: torch.Tensor,
                entry: torch.Tensor, ctx: "StepContext") -> torch.Tensor:
        """One new token per sequence, absorbed (module docstring): writes its cache entry
        ``entry`` [b, 1, 1, L + R] and returns the context [b, H, 1, V]."""
        d = self.dims
        q_latent = torch.matmul(q_nope, self.w_uk)  # [b, H, 1, N] @ [H, N, L] → [b, H, 1, L]
        query = torch.cat([q_latent, q_rot], -1)  # [b, H, 1, L + R]
        cache = ctx.cache.k[layer.slot]  # [batch, 1, max_tokens, L + R]: keys and values
        if ctx.graph_safe:  # no host sync: each row at its device index
            write_rows(cache, ctx.write_index, entry)
            context = layer._captured_decode(query, cache, cache, ctx)
        else:
            write_rows(cache, ctx.write_pos, entry)  # write_pos: [b], each row's position
            context = layer.kernels.attention_decode(query, cache, cache, ctx.lengths,
                                                     starts=ctx.starts, **layer.attn_kw)
        # Σ p c [b, H, 1, L] @ W_UV^T [H, L, V] → each head's value context [b, H, 1, V]
        return torch.matmul(context[..., :d.latent], self.w_uv_t)


def latent_core(layer: nn.Module, spec: Any, index: int) -> LatentAttentionCore | None:
    """The layer's :class:`LatentAttentionCore` when ``spec.attention`` is latent attention,
    else None (the layer's own q/k/v attention runs)."""
    if not isinstance(spec.attention, LatentAttention):
        return None
    return LatentAttentionCore(layer, spec.attention, index)
