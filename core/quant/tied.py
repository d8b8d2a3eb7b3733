"""A quantized output head tied to the input embeddings, stored once.

Many causal LMs (SmolLM2, GPT-2, OPT, BLOOM, Falcon ...) tie the output head to the input
embedding table: one ``[vocab, hidden]`` tensor. Quantizing the head (``quant={"lm_head": ...}``)
then quantizes that table ONCE: the head becomes a :class:`~shardwise.quant.QuantLinear` (the
packed table lives in its buffers; the matmul runs the quantized kernel) and the input embedding
becomes a :class:`QuantEmbedding` that holds no tensor of its own: it reads the rows it looks up
from the head's packed buffers and dequantizes only those
(:func:`shardwise.kernels.reference.quant.packed_rows`). No full-precision copy remains; the
state dict holds the table once, under the head's name (the embedding has no state).

As llama.cpp does for its Q4_0 files (whose tied ``token_embd`` table is Q8_0), a tied head
defaults to 8 bits when the weights get 4 (:meth:`~shardwise.quant.QuantConfig.for_head`).

The packed layout must let rows be read: the reference layout and the CPU backend's native and
int8 layouts do; torch's CPU int4 layout is opaque, so a tied int4 head whose kernel would use it
is refused (:func:`tied_head_problem`), before any layer is quantized.

Under tensor parallelism the head and the embedding are vocab-parallel with the same rows per
rank (the tie survives sharding), so each rank quantizes its own slice of the table once; the
embedding's instance hooks (mask the other ranks' ids, all-reduce) carry over to the
:class:`QuantEmbedding`, which looks up local ids like the ``nn.Embedding`` it replaces.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import ConfigError
from ..ledger import replace_module
from shardwise.kernels.reference.quant import (PackedQuantWeight, QuantizedWeight, packed_rows,
                                               rows_unsupported_reason)

if TYPE_CHECKING:
    from .modules import QuantLinear

#: Probe rows for :func:`tied_head_problem` (one tile of the native layout).
_PROBE_ROWS = 16


class QuantEmbedding(nn.Module):
    """``nn.Embedding`` over the packed table of a tied, quantized output head.

    ``forward(ids [...]) -> [..., embedding_dim]`` in the model's dtype: the rows ``ids`` of the
    head's weight, dequantized (``packed_rows``), exactly the rows the head's kernel multiplies
    with. Holds a plain reference to the head (not a submodule, so the table is one set of
    buffers, moved, cast and saved with the head); a zero-size buffer records the output dtype,
    so ``.to(dtype)`` / ``cast_and_move`` set it as they would an embedding's weight dtype.

    Attributes:
        num_embeddings, embedding_dim, padding_idx: as the replaced ``nn.Embedding``.
        head: the :class:`~shardwise.quant.QuantLinear` holding the table.
        tied_to: the head's module name (for messages and checkpoints).
    """

    #: Byte counters: no weight of its own (the head's buffers are the table).
    counts_buffers_as_weights = False

    def __init__(self, head: "QuantLinear", dtype: torch.dtype, padding_idx: int | None = None,
                 tied_to: str = "lm_head") -> None:
        super().__init__()
        self.__dict__["head"] = head  # a reference, not a submodule: the table is stored once
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.padding_idx, self.tied_to = padding_idx, tied_to
        self.register_buffer("_dtype", torch.empty(0, dtype=dtype), persistent=False)

    @property
    def packed(self) -> PackedQuantWeight:
        """The head's packed table (rebuilt by the head whenever its buffers change)."""
        return self.head.packed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids int [...] → [..., embedding_dim] in the model's dtype."""
        return packed_rows(self.head.packed, ids, self._dtype.dtype)

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the rows it returns (the model's)."""
        return self._dtype.dtype

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tied to {self.tied_to!r} "
                f"(int{self.head.spec.bits}, rows dequantized per lookup), "
                f"dtype={str(self._dtype.dtype).removeprefix('torch.')}")


def input_embedding(model: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of ``model``'s input embeddings (``get_input_embeddings``), or None."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        embed = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        embed = None
    if embed is None:
        return None
    name = next((n for n, m in model.named_modules() if m is embed), None)
    return (name, embed) if name is not None else None


def tied_embedding_name(model: nn.Module, head: nn.Module) -> str | None:
    """The name of the input embedding whose weight IS ``head``'s (one tensor), else None."""
    found = input_embedding(model)
    if found is None:
        return None
    name, embed = found
    weight = getattr(head, "weight", None)
    return name if weight is not None and getattr(embed, "weight", None) is weight else None


def embedding_problem(name: str, embed: nn.Module) -> str | None:
    """Why the input embedding ``name`` cannot become a :class:`QuantEmbedding` (None when it
    can): only a plain ``nn.Embedding`` without max_norm (a subclass may scale or offset its
    rows in its own forward, which the replacement would drop)."""
    if type(embed) is not nn.Embedding:
        return (f"its input embedding {name!r} is a {type(embed).__name__}, not a plain "
                f"nn.Embedding (its forward may change the looked-up rows)")
    if embed.max_norm is not None:
        return f"its input embedding {name!r} renormalizes rows (max_norm={embed.max_norm})"
    return None


def tied_head_problem(kernel_prepack, spec, device: torch.device,
                      dtype: torch.dtype | None) -> str | None:
    """Why a tied head of ``spec`` packed by ``kernel_prepack`` (``impl.fn.prepack``) for
    ``dtype`` on ``device`` cannot serve the embedding lookup (None when it can): packs a
    16-row zero probe of the same bits / group / in_features and asks
    :func:`~shardwise.kernels.reference.quant.rows_unsupported_reason`. Cheap: for checking
    before any layer is quantized."""
    from shardwise.kernels.reference.quant import quantize_weight

    qw: QuantizedWeight = quantize_weight(torch.zeros(_PROBE_ROWS, spec.in_features),
                                          spec.bits, spec.group_size, spec.symmetric)
    packed = kernel_prepack(qw, device, dtype)
    return rows_unsupported_reason(packed)


def refuse_tied(head_name: str, problem: str) -> ConfigError:
    """The ConfigError for a tied head that cannot be quantized once, naming why and what to
    do."""
    return ConfigError(f"quant lm_head: {head_name!r} is tied to the input embeddings and would "
                       f"be stored once, quantized, but {problem}; remove lm_head, or choose "
                       f"lm_head={{'num_bits': 8}}")


def tie_embedding(model: nn.Module, embed_name: str, head: "QuantLinear", head_name: str,
                  dtype: torch.dtype) -> QuantEmbedding:
    """Replace the input embedding ``embed_name`` (tied to ``head_name``, now the quantized
    ``head``) by a :class:`QuantEmbedding` over ``head``'s table, carrying its instance hooks
    (the vocab-parallel mask and all-reduce under tensor parallelism); recorded in the active
    ledger: undoing puts the embedding back (its weight is the head's original Parameter,
    refilled when the head's own swap is undone, so the two stay tied)."""
    from .modules import carry_hooks

    old = model.get_submodule(embed_name)
    new = QuantEmbedding(head, dtype, getattr(old, "padding_idx", None), head_name)
    carry_hooks(old, new)
    parent_name, _, child = embed_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    replace_module(parent, child, new, "quantized tied embedding")  # its undo puts old back
    return new
