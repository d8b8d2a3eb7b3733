"""``QuantLinear``: a drop-in for ``nn.Linear`` / transformers ``Conv1D`` holding a packed
weight-only quantized weight and calling the resolved ``quant_linear`` kernel.

The packed tensors (one backend's layout, made once by ``impl.fn.prepack``) are registered as
buffers, so ``.to(device)``, ``state_dict()`` and ``load_state_dict()`` see them. They keep their
dtypes under ``.to(dtype)`` / ``.half()`` (a packed layout is made for one compute dtype; casting
its scales would change the numbers): cast a quantized model by re-quantizing it. The bias is an
ordinary Parameter in the model's dtype.

Compute dtype: the kernel runs in the dtype the weight was packed for (``compute_dtype``). An
input of another dtype (the model's, when no fast kernel takes it: e.g. an fp32 model on CPU,
whose packed int8/int4 kernels are bf16-only) is cast to it, the kernel runs without the bias,
and its output is cast back to the input's dtype before the bias is added in that dtype. The
added error is that of rounding the input and the output to the compute dtype (bf16: 8 bits of
mantissa, relative 2**-9 each) and the kernel's own (bf16 scales); measured on the tests' tiny
fp32 models against the same quantized weights on the fp32 reference kernel (tests/test_quant.py,
``test_an_fp32_model_runs_the_fast_kernels_in_bf16_close_to_the_fp32_reference``): relative logit
error 0.24-0.29% for int8 and int4, a tenth of the int8 quantization error itself (0.75-1.2%),
with identical greedy tokens.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..kernel_registry import KernelImpl, registry
from ..ledger import active, record, replace_module
from shardwise.kernels.reference.quant import PackedQuantWeight, QuantSpec

#: Hook dicts carried from the module a QuantLinear replaces (shared, so handles keep working).
_HOOK_ATTRS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks",
               "_backward_pre_hooks")


class PackedLayout(nn.Module):
    """Base of the quantized modules whose buffers hold a packed weight layout, and ``_packed``
    the kernel's view over them (built by :meth:`packed_view`). ``.to(dtype)`` moves those
    buffers but never re-rounds them (a dtype cast would ruin the layout); moving, loading a
    state dict or assigning a buffer rebuilds the view eagerly (never lazily in ``forward``: a
    compiled step would otherwise guard on it and recompile)."""

    def packed_view(self) -> Any:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        buffers, self._buffers = self._buffers, {}
        try:
            super()._apply(fn, recurse)  # the biases (and any child) as usual
        finally:
            self._buffers = buffers
        for name, buf in buffers.items():
            if buf is None:
                continue
            moved = fn(buf)
            if moved.dtype != buf.dtype:  # a dtype cast: move only, never re-round the layout
                moved = buf.to(moved.device)
            buffers[name] = moved
        self._packed = self.packed_view()
        return self

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._packed = self.packed_view()

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if "_packed" in self.__dict__ and name in self.__dict__.get("_buffers", {}):
            self._packed = self.packed_view()


class QuantLinear(PackedLayout):
    """``y = x @ dequant(W)ᵀ + bias`` with a packed quantized ``W [out, in]`` (F.linear layout
    whatever the replaced module's layout was).

    Attributes:
        in_features, out_features: as ``nn.Linear``.
        spec: the :class:`QuantSpec` (bits, group size, symmetric, shape).
        backend: the kernel backend the weight is packed for (``"cpu"``, ``"triton"``,
            ``"reference"``); compute_dtype: the activations' dtype it was packed for (inputs of
            another dtype are cast to it and the output cast back: module docstring).
        bias: Parameter [out] or None, in the model's dtype.
    """

    #: Lets byte counters (benchmark roofline, quant report) count these buffers as weights.
    counts_buffers_as_weights = True

    def __init__(self, packed: PackedQuantWeight, kernel: KernelImpl,
                 bias: torch.Tensor | None = None, source: str = "linear") -> None:
        super().__init__()
        spec = packed.spec
        self.in_features, self.out_features = spec.in_features, spec.out_features
        self.spec: QuantSpec = spec
        self.backend: str = packed.backend
        self.compute_dtype: torch.dtype | None = packed.dtype
        self.meta: dict[str, Any] = dict(packed.meta)
        self.source = source  # "linear" or "conv1d": what it replaced
        self.kernel = kernel
        kernel.fn.prepare(self.meta)  # e.g. a native op a later-compiled step calls
        self._tensor_names = tuple(packed.tensors)
        for name, tensor in packed.tensors.items():
            self.register_buffer(name, tensor)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None
        self._packed: PackedQuantWeight = self.packed_view()

    # ----- construction --------------------------------------------------------------------------

    @classmethod
    def empty_like(cls, spec: QuantSpec, backend: str, compute_dtype: torch.dtype | None,
                   meta: dict, shapes: dict[str, tuple[list[int], str]], bias_shape, source,
                   device: torch.device | str | None = None,
                   bias_dtype: torch.dtype | None = None) -> "QuantLinear":
        """A shell with uninitialised buffers of the given shapes/dtypes (for loading a saved
        quantized state dict into); the kernel is ``backend``'s ``quant_linear``. The bias is
        made in ``bias_dtype`` (the model's dtype; default the compute dtype, else fp32)."""
        tensors = {n: torch.empty(shape, dtype=getattr(torch, dt), device=device)
                   for n, (shape, dt) in shapes.items()}
        packed = PackedQuantWeight(backend, spec, compute_dtype, tensors, dict(meta))
        bias_dtype = bias_dtype or compute_dtype or torch.float32
        bias = torch.empty(bias_shape, dtype=bias_dtype, device=device) \
            if bias_shape is not None else None
        return cls(packed, kernel_for_backend(backend), bias, source)

    def describe_tensors(self) -> dict[str, tuple[list[int], str]]:
        """name → (shape, dtype name) of the packed buffers (see :meth:`empty_like`)."""
        return {n: (list(getattr(self, n).shape), str(getattr(self, n).dtype).removeprefix("torch."))
                for n in self._tensor_names}

    # ----- forward -------------------------------------------------------------------------------

    @property
    def packed(self) -> PackedQuantWeight:
        """The packed weight over the current buffers. Rebuilt eagerly whenever they change
        (``.to``, loading, assigning a buffer), never lazily in ``forward``: a compiled step
        (CPU graphs) would otherwise guard on the cache being empty and recompile."""
        return self._packed

    def packed_view(self) -> PackedQuantWeight:
        return PackedQuantWeight(self.backend, self.spec, self.compute_dtype,
                                 {n: getattr(self, n) for n in self._tensor_names}, self.meta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] → [..., out] in x.dtype (module docstring for another dtype than the
        compute dtype)."""
        if self.compute_dtype is None or x.dtype == self.compute_dtype:
            return self.kernel(x, self.packed, self.bias)
        y = self.kernel(x.to(self.compute_dtype), self.packed, None).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    @property
    def weight_nbytes(self) -> int:
        """Bytes of the packed weight (scales and zeros included), bias excluded."""
        return sum(getattr(self, n).numel() * getattr(self, n).element_size()
                   for n in self._tensor_names)

    def extra_repr(self) -> str:
        s = self.spec
        groups = "per-channel" if s.group_size == s.in_features else f"group={s.group_size}"
        return (f"in_features={s.in_features}, out_features={s.out_features}, int{s.bits}, "
                f"{groups}, {'sym' if s.symmetric else 'asym'}, backend={self.backend}, "
                f"compute={str(self.compute_dtype).removeprefix('torch.')}, "
                f"bias={self.bias is not None}")

    @torch.no_grad()
    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float ``[out, in]`` weight this layer computes with, in ``dtype`` (default: the
        bias's dtype, else the compute dtype, else float32).

        Reference-packed weights are dequantized exactly (``(q - zero) * scale`` in float32).
        Other backends' layouts are opaque (torch's CPU int4 layout), so the layer's own kernel
        is run on the identity, a block of rows at a time: row ``i`` of ``I @ Wᵀ`` is column
        ``i`` of ``W`` as the kernel computes it (its scales' dtype and its output rounding in
        the compute dtype, e.g. bf16). That costs one ``[in, in] x [in, out]`` product per
        layer: fine for giving a model back, not a per-step path."""
        from shardwise.kernels.reference.quant import dequantize_weight, unpacked

        if dtype is None:
            dtype = self.bias.dtype if self.bias is not None else (self.compute_dtype
                                                                    or torch.float32)
        if self.backend == "reference":
            return dequantize_weight(unpacked(self.packed)).to(dtype)
        compute = self.compute_dtype or dtype
        device = next(iter(self._buffers.values())).device
        columns = []  # each [rows, out]: W[:, rows]ᵀ
        for start in range(0, self.in_features, _IDENTITY_ROWS):
            rows = min(_IDENTITY_ROWS, self.in_features - start)
            eye = torch.zeros(rows, self.in_features, dtype=compute, device=device)
            eye[:, start:start + rows].fill_diagonal_(1)
            columns.append(self.kernel(eye, self.packed, None).to(dtype))
        return torch.cat(columns).t().contiguous()

    def to_float_module(self, dtype: torch.dtype | None = None) -> nn.Module:
        """A float module computing what this one does: an ``nn.Linear`` (or a transformers
        ``Conv1D`` when it replaced one) holding :meth:`dequantized_weight` (lossy: the
        weight before quantization is not recoverable) and the bias, sharing this module's
        instance hooks."""
        weight = self.dequantized_weight(dtype)  # [out, in]
        has_bias = self.bias is not None
        if self.source == "conv1d":
            from transformers.pytorch_utils import Conv1D

            module = Conv1D(self.out_features, self.in_features).to(weight.device)
            module.weight = nn.Parameter(weight.t().contiguous(), requires_grad=False)
            module.bias = nn.Parameter(self.bias.detach().to(weight.dtype), requires_grad=False) \
                if has_bias else None
        else:
            module = nn.Linear(self.in_features, self.out_features, bias=has_bias,
                               device="meta")
            module.weight = nn.Parameter(weight, requires_grad=False)
            if has_bias:
                module.bias = nn.Parameter(self.bias.detach().to(weight.dtype),
                                           requires_grad=False)
        carry_hooks(self, module)
        return module.train(self.training)


#: rows of the identity per kernel call in :meth:`QuantLinear.dequantized_weight`
_IDENTITY_ROWS = 1024


#: backend → (packed tensor name → the dimension its output rows run along, counted from the
#: end; output rows per index along it) for the layouts whose kernel does not say itself
#: (``row_dims(meta)`` on the kernel, e.g. the CPU backend's): the reference's ``qweight``
#: [N, K or K / 2], ``scales``/``zeros`` [N, n_groups]; Triton's the same with ``offsets``
_ROW_DIMS: dict[str, tuple[dict[str, int], int]] = {
    "reference": ({"qweight": -2, "scales": -2, "zeros": -2}, 1),
    "triton": ({"qweight": -2, "scales": -2, "offsets": -2}, 1),
}


def quant_row_dims(module: QuantLinear) -> tuple[dict[str, int], int] | None:
    """Where ``module``'s packed tensors stack their output rows: (tensor name → dimension,
    counted from the end; output rows per index along it), so modules of one layout with
    equal settings concatenate along it into one wider module (fused projections:
    :mod:`shardwise.inject.fuse`); None for a layout that does not stack its rows (torch's
    opaque CPU int4 layout) or that no table describes."""
    own = getattr(module.kernel.fn, "row_dims", None)
    if callable(own):
        return own(module.meta)
    return _ROW_DIMS.get(module.backend)


def kernel_for_backend(backend: str, op: str = "quant_linear") -> KernelImpl:
    """``backend``'s implementation of ``op`` (``quant_linear``, ``quant_moe_mlp``; its module
    imported on demand); KeyError naming it when that backend cannot run here."""
    error = registry.load_backend(backend)
    impl = registry.implementations(op).get(backend)
    if impl is None:
        raise KeyError(f"{op} backend {backend!r} is not available here"
                       f"{': ' + error if error else ''}")
    return impl


def carry_hooks(old: nn.Module, new: nn.Module) -> None:
    """Make ``new`` run ``old``'s instance hooks (e.g. tensor parallelism's all-reduce after a
    row-parallel linear): the hook dicts are shared, so existing handles still remove them."""
    for attr in _HOOK_ATTRS:
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))


def swap_quantized(model: nn.Module, name: str, new: nn.Module, what: str, undo_what: str,
                   make_undo, float_params: tuple[str, ...]) -> None:
    """Put the quantized ``new`` in place of module ``name``, carrying its instance hooks, and
    record in the active ledger ``make_undo(old)``: the undo that puts ``old`` back with its
    weights rebuilt by dequantizing ``new`` (``undo_what`` says so). Inside ``init_inference``
    ``old``'s ``float_params`` are emptied (the undo rebuilds them; ``old`` outlives the swap in
    the undo, and would otherwise hold a second, float copy of the weights)."""
    old = model.get_submodule(name)
    carry_hooks(old, new)
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    replace_module(parent, child, new, what)
    record(undo_what, make_undo(old))
    if active() is None:
        return
    with torch.no_grad():
        for param in float_params:
            tensor = getattr(old, param)
            if not tensor.is_meta:
                tensor.data = tensor.data.new_empty(0)
