"""Kernel injection for encoder-only models (BERT): post-LayerNorm layers, non-causal attention,
no KV cache.

A family policy sets ``injection = EncoderInjectionSpec(...)``; :func:`inject_encoder` (called by
:func:`shardwise.inject.inject_model` when it sees that spec) replaces the HF encoder module
(``model.base_model.encoder``, e.g. ``BertEncoder``) in place with :class:`InjectedEncoder`.
Everything outside the encoder — embeddings, pooler, task heads, ``BertModel.forward`` and its
mask construction — stays HF's, so every ``BertFor*`` shell works unchanged.

As with the decoder (:mod:`shardwise.inject.layers`), the new modules *adopt* the HF children
under their own names (``encoder.layer.0.attention.self.query`` keeps its name and its
parameters), so ``state_dict``/``save_pretrained`` are unchanged, and the projections are called
as modules, so tensor-parallel hooks (row-parallel all-reduce) run; the local head count is read
from the local weight shapes.

One layer (``x`` the residual stream [batch, seq, hidden])::

    attn = out_proj(attention(q(x), k(x), v(x), key_padding_mask))  # non-causal
    x = layer_norm(attn + x)                                         # attention post-norm
    x = layer_norm(mlp_out(gelu(mlp_in(x))) + x)                     # output post-norm

with the registry's ``attention_prefill`` (``causal=False``), ``layer_norm`` (fused residual add)
and ``bias_gelu`` kernels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions as EncoderOutput

from ..accelerator import Accelerator
from ..errors import ShardwiseError
from ..ledger import replace_module
from .injector import InjectionError, resolve_ops
from ..pipeline.transform import RemoteLayer
from .layers import out_width, stage_of
from .spec import ACTIVATIONS, GroupedSpec

log = logging.getLogger(__name__)

#: kernel slot of the encoder layer → registry op
OPS = {"norm": "layer_norm", "act": "bias_gelu", "attention": "attention_prefill"}
#: forward keyword arguments of packed (varlen) sequences, which a key padding mask cannot express
PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _names_problems(**names: Any) -> list[str]:
    """Each value that is not a non-empty dotted module name."""
    return [f"{k}={v!r} (a dotted module name)" for k, v in names.items()
            if not isinstance(v, str) or not v]


@dataclass(frozen=True)
class EncoderAttention:
    """The attention block of one post-norm encoder layer,
    ``norm(out_proj(attention(q, k, v)) + x)`` (validated on construction).

    Attributes:
        qkv: three projections (``query``, ``key``, ``value``) or one fused ``[q | k | v]``
            (equal thirds: encoders are multi-head) — linears, transformers ``Conv1D``s or
            quantized linears. The head scale is read from their parent module's ``scaling``
            when it has one.
        out_proj: the attention output projection (row-parallel under TP).
        norm: the LayerNorm after the attention residual add.
    """

    qkv: tuple[str, ...]
    out_proj: str
    norm: str

    def __post_init__(self) -> None:
        problems = _names_problems(out_proj=self.out_proj, norm=self.norm)
        if not isinstance(self.qkv, tuple) or len(self.qkv) not in (1, 3) or \
                not all(isinstance(n, str) and n for n in self.qkv):
            problems.append(f"qkv={self.qkv!r} (one fused or three projections, as a tuple)")
        if problems:
            raise ValueError("invalid EncoderAttention: " + "; ".join(problems))


@dataclass(frozen=True)
class EncoderMLP:
    """The MLP block of one post-norm encoder layer, ``norm(out_proj(act(in_proj(x))) + x)``
    (validated on construction).

    Attributes:
        in_proj: the input projection (column-parallel under TP), then the activation.
        out_proj: the output projection (row-parallel under TP).
        norm: the LayerNorm after the MLP residual add.
        activation_config: config attributes naming the activation, tried in order (a GELU of
            :data:`~shardwise.inject.spec.ACTIVATIONS`).
    """

    in_proj: str
    out_proj: str
    norm: str
    activation_config: tuple[str, ...] = ("hidden_act",)

    def __post_init__(self) -> None:
        problems = _names_problems(in_proj=self.in_proj, out_proj=self.out_proj, norm=self.norm)
        if not isinstance(self.activation_config, tuple) or not self.activation_config:
            problems.append(f"activation_config={self.activation_config!r} (a non-empty tuple)")
        if problems:
            raise ValueError("invalid EncoderMLP: " + "; ".join(problems))


@dataclass(frozen=True)
class EncoderInjectionSpec(GroupedSpec):
    """One encoder family's layer layout, as data (validated on construction).

    Names are dotted attribute paths: ``encoder`` on the base model (HF's ``model.base_model``:
    the ``BertModel`` itself or ``BertForMaskedLM.bert``), ``layers`` on the encoder, the rest on
    one encoder layer.

    Attributes:
        encoder: the encoder module replaced in place (``"encoder"``).
        layers: the ``ModuleList`` of layers on the encoder (``"layer"``).
        attention: the attention block and its post-norm (:class:`EncoderAttention`).
        mlp: the MLP block and its post-norm (:class:`EncoderMLP`).
        require_config: ``(attribute, value)`` pairs: the only config value the injected encoder
            implements (a config without the attribute passes).

    Raises:
        MovedFieldError: built, replaced or read with a flat field of earlier versions
            (``qkv=``, ``attn_norm=`` …; the message maps each to its group).
        ValueError: a group is missing or of the wrong type, or a value is invalid.
    """

    encoder: str
    layers: str
    attention: EncoderAttention
    mlp: EncoderMLP
    require_config: tuple[tuple[str, Any], ...] = ()

    _moved = {"qkv": "attention.qkv", "out_proj": "attention.out_proj",
              "attn_norm": "attention.norm", "mlp_in": "mlp.in_proj", "mlp_out": "mlp.out_proj",
              "mlp_norm": "mlp.norm", "activation_config": "mlp.activation_config"}
    _groups = {"attention": EncoderAttention, "mlp": EncoderMLP}
    _layout = ("encoder, layers, attention=EncoderAttention(qkv, out_proj, norm), "
               "mlp=EncoderMLP(in_proj, out_proj, norm, activation_config), require_config")

    def __post_init__(self) -> None:
        problems = _names_problems(encoder=self.encoder, layers=self.layers)
        problems += self._group_problems()
        if not all(isinstance(r, tuple) and len(r) == 2 for r in self.require_config):
            problems.append(f"require_config={self.require_config!r} ((attribute, value) pairs)")
        if problems:
            raise ValueError("invalid EncoderInjectionSpec: " + "; ".join(problems))


@dataclass
class EncoderKernels:
    """The op implementations one injected encoder calls (resolved once, for its dtype)."""

    norm: Callable
    act: Callable
    attention: Callable
    backends: dict[str, str]


def resolve_encoder_kernels(accelerator: Accelerator, dtype: torch.dtype) -> EncoderKernels:
    """Resolve :data:`OPS` for ``dtype`` (fallbacks logged in one line, as for decoders)."""
    fns, backends = resolve_ops(accelerator, dtype, OPS, what="encoder injection")
    return EncoderKernels(**fns, backends=backends)


# ----- masks --------------------------------------------------------------------------------------

def key_padding_mask(mask: Any, batch: int, seq: int) -> torch.Tensor | None:
    """The key padding mask [batch, seq] bool (True = a real token) of the attention mask HF's
    encoder receives, or None when every key is visible.

    Accepted: None; a 2-d [batch, seq] 0/1 or bool mask (flash-attention implementations pass
    the user's mask as is); a 4-d [batch | 1, 1 | heads, seq, seq] mask as ``BertModel`` builds
    it — bool (sdpa: True = visible) or additive float (eager: 0 = visible, the dtype's minimum
    or -inf = hidden) — whose rows all agree, i.e. padding only. Anything else (a mask that
    differs between queries or heads, additive biases, a flex ``BlockMask``) raises
    ShardwiseError: the injected attention takes a key padding mask only.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise ShardwiseError(f"the injected encoder takes a tensor attention mask, got "
                             f"{type(mask).__name__} (a flex-attention BlockMask?); use the "
                             f"'sdpa' or 'eager' attention implementation")
    if mask.dim() == 2:
        visible = _bool_or_additive(mask)[:, None, None, :]  # [batch, 1, 1, seq]
    elif mask.dim() == 4:
        visible = _bool_or_additive(mask)  # [batch | 1, heads | 1, seq, seq]
    else:
        raise ShardwiseError(f"the injected encoder takes a 2-d [batch, tokens] or 4-d [batch, "
                             f"1, tokens, tokens] attention mask, got shape {tuple(mask.shape)}")
    if visible.shape[0] not in (1, batch) or visible.shape[-1] != seq or \
            visible.shape[-2] not in (1, seq):
        raise ShardwiseError(f"attention mask of shape {tuple(mask.shape)} does not fit "
                             f"{batch} sequences of {seq} tokens")
    keys = visible[:, :1, :1, :]  # [batch | 1, 1, 1, seq]: the first query row of the first head
    if not torch.equal(visible, keys.expand_as(visible)):
        raise ShardwiseError("the injected encoder supports padding masks only (every query sees "
                             "the same keys); got a 4-d attention mask that differs between "
                             "queries or heads. Run without replace_with_kernel_inject for "
                             "custom masks")
    keys = keys[:, 0, 0, :].expand(batch, seq)  # [batch, seq]
    return None if bool(keys.all()) else keys


def _bool_or_additive(mask: torch.Tensor) -> torch.Tensor:
    """Visibility (bool, same shape) of a bool / 0-1 integer / additive float mask."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ShardwiseError("an integer attention mask must hold 0s and 1s only")
        return mask.bool()
    if mask.dim() == 2:  # a user's [batch, tokens] mask in a float dtype: 1 = keep
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ShardwiseError("a 2-d float attention mask must hold 0s and 1s only")
        return mask.bool()
    visible = mask == 0
    hidden = (mask <= torch.finfo(mask.dtype).min / 2) | torch.isneginf(mask)
    if not bool((visible | hidden).all()):
        raise ShardwiseError("the injected encoder takes padding masks only; this additive float "
                             "attention mask holds biases other than 0 (visible) and the dtype's "
                             "minimum / -inf (hidden)")
    return visible


# ----- modules ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class EncoderLayerParts:
    """The adopted submodules one encoder layer calls, as plain (unregistered) references: the
    layer registered them under their HF names, so ``state_dict`` names stay HF's. Each is used
    as found (a linear, a ``Conv1D``, a quantized linear) and called as a module, so its hooks
    (tensor-parallel all-reduce) run."""

    qkv: tuple[nn.Module, ...]  # query, key, value — or one fused [q | k | v]
    out_proj: nn.Module
    attn_norm: nn.Module
    mlp_in: nn.Module
    mlp_out: nn.Module
    mlp_norm: nn.Module

    @classmethod
    def of(cls, layer: nn.Module, spec: "EncoderInjectionSpec") -> "EncoderLayerParts":
        """The modules ``spec`` names, read from ``layer`` now."""
        get = layer.get_submodule
        attention, mlp = spec.attention, spec.mlp
        return cls(qkv=tuple(get(n) for n in attention.qkv), out_proj=get(attention.out_proj),
                   attn_norm=get(attention.norm), mlp_in=get(mlp.in_proj),
                   mlp_out=get(mlp.out_proj), mlp_norm=get(mlp.norm))


class InjectedEncoderLayer(nn.Module):
    """One post-norm encoder layer on the registry's kernels (see the module docstring)."""

    def __init__(self, hf_layer: nn.Module, spec: EncoderInjectionSpec, kernels: EncoderKernels,
                 head_dim: int, scale: float, approximate: str) -> None:
        super().__init__()
        for name, child in hf_layer.named_children():  # adopt: same names, same parameters
            self.add_module(name, child)
        self.spec, self.kernels = spec, kernels
        self.head_dim, self.scale, self.approximate = head_dim, scale, approximate
        self._bind_adopted()
        qkv = self.parts.qkv
        widths = ([out_width(qkv[0]) // 3] * 3 if len(qkv) == 1
                  else [out_width(proj) for proj in qkv])
        if len(set(widths)) != 1 or widths[0] % head_dim:
            raise InjectionError(f"q/k/v widths {widths} are not equal multiples of head_dim "
                                 f"{head_dim}; the injected encoder runs multi-head attention")
        self.width = widths[0]  # local heads × head_dim (this rank's heads under TP)
        self.heads = self.width // head_dim

    def _bind_adopted(self) -> None:
        """Read the adopted submodules named by the spec, once: injection runs after every
        transform that swaps modules (quantization), so they are the ones the model keeps."""
        self.parts = EncoderLayerParts.of(self, self.spec)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        """x [batch, seq, hidden], key_padding_mask [batch, seq] bool or None → [batch, seq,
        hidden]."""
        parts = self.parts
        x = self._norm(parts.attn_norm, self._attention(x, key_padding_mask), x)
        # [batch, seq, intermediate (this rank's part under TP)]
        activated = self.kernels.act(parts.mlp_in(x), None, self.approximate)
        return self._norm(parts.mlp_norm, parts.mlp_out(activated), x)

    def _norm(self, module: nn.Module, delta: torch.Tensor, residual: torch.Tensor):
        """LayerNorm(delta + residual), fused: [batch, seq, hidden]."""
        return self.kernels.norm(delta, module.weight, module.bias, module.eps,
                                 residual=residual)[0]

    def _attention(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x [b, s, hidden] → the attention's output projection [b, s, hidden]."""
        b, s, _ = x.shape
        qkv = self.parts.qkv
        if len(qkv) == 1:
            q, k, v = qkv[0](x).split(self.width, dim=-1)  # each [b, s, heads * d]
        else:
            q, k, v = (proj(x) for proj in qkv)
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2)  # [b, heads, s, d]
                   for t in (q, k, v))
        context = self.kernels.attention(q, k, v, causal=False, key_padding_mask=mask,
                                         scale=self.scale)  # [b, heads, s, d]
        return self.parts.out_proj(context.transpose(1, 2).reshape(b, s, self.width))


class InjectedEncoder(nn.Module):
    """The encoder that replaces the HF one in place (see the module docstring).

    Its forward takes what ``BertModel.forward`` passes its encoder (the embeddings, the mask it
    built, cross-attention and cache arguments, HF kwargs) and returns a
    ``BaseModelOutputWithPastAndCrossAttentions`` with ``last_hidden_state`` only.
    """

    def __init__(self, hf_encoder: nn.Module, spec: EncoderInjectionSpec,
                 kernels: EncoderKernels, head_dim: int, scales: list[float],
                 approximate: str, config: Any) -> None:
        super().__init__()
        self.config = config  # the model's (shared) config: output_* flags are read from it
        self.spec, self.kernels = spec, kernels
        hf_layers = hf_encoder.get_submodule(spec.layers)
        self._stage = stage_of(hf_layers)  # the pipeline stage's link, or None (whole model)
        layers = nn.ModuleList(
            layer if isinstance(layer, RemoteLayer)
            else InjectedEncoderLayer(layer, spec, kernels, head_dim, scales[i], approximate)
            for i, layer in enumerate(hf_layers))
        for name, child in hf_encoder.named_children():  # same names, same order
            self.add_module(name, layers if child is hf_layers else child)
        self._layers = [layers]  # unregistered handle (the ModuleList is registered above)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Any = None,
                encoder_hidden_states: torch.Tensor | None = None,
                encoder_attention_mask: torch.Tensor | None = None,
                past_key_values: Any = None, use_cache: bool | None = None,
                **kwargs: Any) -> EncoderOutput:
        """hidden_states [batch, seq, hidden] (the embeddings) → ``last_hidden_state`` [batch,
        seq, hidden]. Raises ShardwiseError for what it does not implement (see
        :meth:`_refuse`)."""
        self._refuse(encoder_hidden_states, past_key_values, use_cache, kwargs)
        b, s = hidden_states.shape[:2]
        mask = key_padding_mask(attention_mask, b, s)
        if mask is not None:
            mask = mask.to(hidden_states.device)
        x = hidden_states
        stage = self._stage
        if stage is None:
            for layer in self._layers[0]:
                x = layer(x, mask)
        else:  # this stage's layers, between the previous stage's hidden states and the next
            x = stage.receive(x)
            for i in stage.layers:
                x = self._layers[0][i](x, mask)
            stage.send(x)
            x = stage.output(x)  # the last stage's hidden states, on every rank
        return EncoderOutput(last_hidden_state=x, past_key_values=None)

    def _refuse(self, encoder_hidden_states, past_key_values, use_cache, kwargs) -> None:
        """Per-layer attentions / hidden states (HF records them with hooks on its own layer
        classes, which are gone: they would come back empty), cross-attention, a KV cache and
        packed sequences are not implemented: a clear error instead of silently wrong output."""
        config = self.config
        wanted = [name for name in ("output_attentions", "output_hidden_states")
                  if (kwargs.get(name) if kwargs.get(name) is not None
                      else getattr(config, name, False))]
        if wanted:
            raise ShardwiseError(f"the injected encoder does not return per-layer attentions or "
                                 f"hidden states ({' and '.join(wanted)} requested); "
                                 f"init_inference without replace_with_kernel_inject runs the HF "
                                 f"layers that do")
        if encoder_hidden_states is not None:
            raise ShardwiseError("the injected encoder has no cross-attention "
                                 "(encoder_hidden_states was given)")
        if past_key_values is not None or use_cache:
            raise ShardwiseError("the injected encoder keeps no KV cache (past_key_values / "
                                 "use_cache were given)")
        packed = [k for k in PACKED_KWARGS if kwargs.get(k) is not None]
        if packed:
            raise ShardwiseError(f"the injected encoder does not run packed sequences ({packed}); "
                                 f"pad the batch and pass an attention_mask")


# ----- injection ----------------------------------------------------------------------------------

def _check_config(config: Any, spec: EncoderInjectionSpec) -> str:
    """Refuse settings the injected encoder does not implement; returns the GELU approximation."""
    for attr, value in (("is_decoder", False), ("add_cross_attention", False),
                        *spec.require_config):
        actual = getattr(config, attr, value)
        if actual != value:
            raise InjectionError(f"config.{attr}={actual!r} is not supported by the injected "
                                 f"encoder (it implements {attr}={value!r}); run without "
                                 f"replace_with_kernel_inject")
    act = next((v for v in (getattr(config, n, None) for n in spec.mlp.activation_config)
                if v is not None), None)
    if not isinstance(act, str) or ACTIVATIONS.get(act, ("",))[0] != "bias_gelu":
        gelus = [n for n, (op, _) in ACTIVATIONS.items() if op == "bias_gelu"]
        raise InjectionError(f"activation {act!r} is not supported by the injected encoder "
                             f"(supported: {', '.join(gelus)}); run without "
                             f"replace_with_kernel_inject")
    return ACTIVATIONS[act][1]


def _scale(hf_layer: nn.Module, spec: EncoderInjectionSpec, head_dim: int) -> float:
    """The attention scale: the HF attention module's ``scaling``, else ``head_dim ** -0.5``."""
    parent = spec.attention.qkv[0].rpartition(".")[0]
    scale = getattr(hf_layer.get_submodule(parent) if parent else hf_layer, "scaling", None)
    return float(head_dim ** -0.5 if scale is None else scale)


def inject_encoder(model: nn.Module, policy: Any, spec: EncoderInjectionSpec,
                   accelerator: Accelerator, dtype: torch.dtype) -> InjectedEncoder:
    """Replace ``model``'s encoder (``model.base_model`` + ``spec.encoder``) in place with an
    :class:`InjectedEncoder` on kernels resolved for ``accelerator`` and ``dtype``; run after
    sharding (the layers call the sharded projections and their hooks). Returns the new encoder.

    Raises:
        InjectionError: the model has no such encoder or is already injected, the policy finds no
            head counts, or the config asks for something the injected encoder does not
            implement (a decoder / cross-attention config, a non-GELU activation, a value
            outside ``spec.require_config``).
    """
    base = getattr(model, "base_model", model)
    parent_name, _, attr = spec.encoder.rpartition(".")
    parent = base.get_submodule(parent_name) if parent_name else base
    hf_encoder = getattr(parent, attr, None)
    if isinstance(hf_encoder, InjectedEncoder):
        raise InjectionError(f"{type(model).__name__} is already injected")
    if not isinstance(hf_encoder, nn.Module) or parent._modules.get(attr) is not hf_encoder:
        raise InjectionError(f"policy {policy.name!r}: {type(model).__name__} has no encoder "
                             f"{spec.encoder!r}")
    approximate = _check_config(model.config, spec)
    counts = policy.head_counts(model.config)
    if counts is None:
        raise InjectionError(f"policy {policy.name!r} finds no head counts in the config")
    kernels = resolve_encoder_kernels(accelerator, dtype)
    hf_layers = hf_encoder.get_submodule(spec.layers)
    # a pipeline stage's stand-ins for other stages' layers hold no weights: no scale
    scales = [None if isinstance(layer, RemoteLayer) else _scale(layer, spec, counts.head_dim)
              for layer in hf_layers]
    injected = InjectedEncoder(hf_encoder, spec, kernels, counts.head_dim, scales, approximate,
                               model.config)
    replace_module(parent, attr, injected, "injected encoder")
    log.info("shardwise: injected %d %s encoder layers (kernels: %s)", len(hf_layers),
             policy.name, ", ".join(f"{op}={b}" for op, b in kernels.backends.items()))
    return injected


def injected_encoder(model: nn.Module) -> InjectedEncoder | None:
    """The :class:`InjectedEncoder` inside ``model`` (None when it has none)."""
    return next((m for m in model.modules() if isinstance(m, InjectedEncoder)), None)
