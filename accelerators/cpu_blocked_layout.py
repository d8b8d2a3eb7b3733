"""The CPU decode-step graphs' weight layout: one copy of each fp32 linear weight, laid out in
the column blocks the C++ GEMM template of inductor reads in place (:func:`block_weight`), read by
the compiled step and the eager forward alike. bf16/fp16 linear weights take the same layout
where the native kernel that reads it builds (:func:`half_blocked_linear`). With a storage
dtype (``init_inference(weight_dtype=torch.bfloat16 | torch.float16)`` on an fp32 model) the
fp32 weights are laid out in 16 bits, rounded once, and multiplied by fp32 activations with
nothing else rounded (:func:`half_blocked_linear`).

:func:`block_linear_weights` lays a model's linears out, in place and instance-scoped (a
:class:`BlockedLinear` forward, a :class:`PlainLayoutInStateDict` hook so ``state_dict`` still
gives the usual layout). Inside ``init_inference`` each change is recorded in the ledger
(:mod:`shardwise.ledger`), the weights' undo re-laying the plain layout from the blocked tensor
(:func:`unblock_weight`), so giving the model back needs no second copy of the weights.
Used by :class:`~shardwise.accelerators.cpu_graphs.CpuCompileStrategy`.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.ledger import add_hook, record, set_forward

#: Output columns per block of a weight laid out by :func:`block_weight` (two AVX-512 vectors of
#: fp32: the C++ GEMM template's own ``block_n``, so its batched GEMM reads the blocks as they are).
BLOCK_N = 32
#: 16-bit weight dtypes laid out too (read by the native kernel: :func:`half_blocked_linear`).
HALF_DTYPES = (torch.bfloat16, torch.float16)
#: Up to this many rows the native 16-bit op's widening loops run (fp16, and bf16 on CPUs
#: without AVX512-BF16), beyond it ATen's GEMM on the reassembled weight (``half.cpp``'s
#: constant of the same name, which decides; ``python benchmarks/kernel_half_linear.py``,
#: benchmarks/README.md, "bf16 decode on the CPU").
NATIVE_ROWS = 64


def block_weight(mat2: torch.Tensor, block: int = BLOCK_N) -> torch.Tensor:
    """``mat2`` [K, N] (the right operand of ``x @ mat2``) as contiguous blocks of ``block``
    columns, [ceil(N / block), K, block] (the last block zero-padded): block ``j`` is
    ``mat2[:, j*block:(j+1)*block]``. A new tensor; ``mat2`` is left as it is."""
    k, n = mat2.shape
    pad = -n % block
    if pad:
        mat2 = F.pad(mat2, (0, pad))
    return mat2.reshape(k, (n + pad) // block, block).transpose(0, 1).contiguous()


def unblock_weight(blocked: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`block_weight`'s inverse: ``mat2`` [K, n] from its blocks [ceil(n / block), K,
    block] (a new tensor)."""
    nb, k, block = blocked.shape
    return blocked.detach().transpose(0, 1).reshape(k, nb * block)[:, :n].contiguous()


class PlainLayoutInStateDict:
    """``state_dict`` post-hook of a module whose weight holds :func:`block_weight`'s layout
    (instance-scoped, registered by :func:`block_linear_weights`): the ``weight`` entry is
    given in the module's usual layout — [N, K] for ``nn.Linear``/``nn.Embedding``, [K, N] for
    ``Conv1D`` — so ``save_pretrained`` and ``engine.save_checkpoint`` write what they would
    without graphs. A weight tied between a head and an embedding is unblocked once per
    ``state_dict`` call and both entries get the same tensor (the tie stays visible)."""

    def __init__(self, n: int, transpose: bool) -> None:
        self.n, self.transpose = n, transpose

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, _meta: object) -> None:
        key = prefix + "weight"
        if key not in state_dict:
            return
        done = _unblocked_so_far(state_dict)  # id(Parameter) -> plain tensor
        plain = done.get(id(module.weight))
        if plain is None:
            mat2 = unblock_weight(module.weight, self.n)  # [K, N]
            plain = done[id(module.weight)] = mat2.t().contiguous() if self.transpose else mat2
        state_dict[key] = plain


def _unblocked_so_far(state_dict: dict) -> dict[int, torch.Tensor]:
    """The weights this ``state_dict`` call already put back in their usual layout, kept on
    the dict being built (torch's is an ``OrderedDict``, which takes attributes as it takes
    ``_metadata``); a destination that takes none shares nothing."""
    done = getattr(state_dict, "_shardwise_unblocked", None)
    if done is None:
        done = {}
        try:
            state_dict._shardwise_unblocked = done
        except AttributeError:
            pass
    return done


def blocked_matmul(x: torch.Tensor, blocked: torch.Tensor, n: int) -> torch.Tensor:
    """``x @ mat2`` for ``blocked = block_weight(mat2)``: x [..., K] → [..., n].

    Compiled, one batched GEMM over the blocks (inductor's C++ template reads ``blocked`` in
    place: the weight is a graph input, not a frozen copy). Eager, the same batched GEMM when
    the row count is at most the block width (the rows repeated per block are then at most
    the weight's size), else one GEMM on the weight put back together (:func:`reassembled`:
    prefill)."""
    *lead, k = x.shape
    rows = x.reshape(-1, k)  # [M, K]
    nb, _, block = blocked.shape
    m = rows.shape[0]
    if torch.compiler.is_compiling() and m == 1:
        # inductor lowers a one-row bmm to a plain reduction loop, not the C++ GEMM template
        # (a clearly slower step: benchmarks/README.md, "The default layout (cpp) in detail"):
        # a second, discarded row keeps the template, which still reads each weight once
        rows = F.pad(rows, (0, 0, 0, 1))
    if torch.compiler.is_compiling() or m <= block:
        out = torch.bmm(rows.unsqueeze(0).expand(nb, rows.shape[0], k), blocked)  # [Nb, M', b]
        out = out[:, :m].transpose(0, 1).reshape(m, nb * block)[:, :n]
    else:
        out = rows @ reassembled(blocked, n)
    return out.reshape(*lead, n)


def half_blocked_linear(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None,
                        n: int, native_op: bool = True) -> torch.Tensor:
    """``x @ mat2 + bias`` for a 16-bit ``blocked = block_weight(mat2)``: x [..., K] → [..., n]
    in x's dtype, with ``F.linear``'s 16-bit contract (fp32 products and sums, the bias added in
    fp32, rounded once).

    The native op (``kernels/cpu/native/half.cpp``), eager and compiled alike, at any row
    count: its own loops read the blocks, one row at about the copy bandwidth, where ATen's
    16-bit GEMV and small GEMMs read a weight at well under it (bf16 on a CPU with
    AVX512-BF16 at every row count; fp16, and bf16 elsewhere, up to :data:`NATIVE_ROWS` rows,
    beyond which the op runs ATen's GEMM on the weight reassembled into a per-thread buffer,
    the bias in x's dtype as ``F.linear``). x in another dtype than the weight, or autograd
    recording (the op has no backward): ATen's GEMM on :func:`reassembled`. An fp32 x under a
    16-bit weight (a storage dtype: :func:`block_linear_weights`): y = x @ float(W) + b in
    fp32, nothing rounded (the op's widening loops, or ATen's fp32 GEMM on the weight widened
    as it is reassembled past :data:`NATIVE_ROWS` rows). ``native_op=False`` (the extension
    does not build, or is opted out: :func:`native_half_ready`): ATen's GEMM on
    :func:`reassembled` always (correct, and slower)."""
    from shardwise.kernels.cpu import native

    *lead, k = x.shape
    rows = x.reshape(-1, k)  # [M, K]
    grad = torch.is_grad_enabled() and (x.requires_grad or blocked.requires_grad)
    if native_op and x.dtype in (blocked.dtype, torch.float32) and not grad:
        out = native.cpu_blocked_linear(rows, blocked, bias, n)
    else:  # the weight widened exactly to x's dtype where it is wider (fp32 compute)
        out = F.linear(rows, reassembled(blocked, n).t().to(rows.dtype), bias)
    return out.reshape(*lead, n)


_scratch = threading.local()
#: The largest weight :func:`reassembled` keeps a buffer for (a 1.7B model's MLP weights in
#: fp32 are 64 MiB); a larger one (an fp32 output head: hundreds of MiB) is reassembled into a
#: transient tensor, so no thread holds that much for good.
SCRATCH_MAX_BYTES = 64 << 20


def reassembled(blocked: torch.Tensor, n: int) -> torch.Tensor:
    """The plain ``mat2`` [K, n] of ``blocked = block_weight(mat2)`` for one product: eager, a
    view of a per-thread buffer that is reused (and grows to the largest weight up to
    :data:`SCRATCH_MAX_BYTES`), since a fresh tensor of a weight's size costs its page faults at
    every call (~2 GB/s here against ~6 for the copy itself: a 1.7B model's prompt spent ~1.8 s
    on them); compiled or under autograd, a new tensor. The view is valid until the thread's
    next call."""
    nb, k, block = blocked.shape
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and blocked.requires_grad):
        return blocked.transpose(0, 1).reshape(k, nb * block)[:, :n]
    nbytes = blocked.numel() * blocked.element_size()
    if nbytes > SCRATCH_MAX_BYTES:  # e.g. an output head: transient, not kept for good
        return blocked.transpose(0, 1).reshape(k, nb * block)[:, :n]
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < nbytes:
        buf = _scratch.buf = torch.empty(nbytes, dtype=torch.uint8)
    mat2 = buf[:nbytes].view(blocked.dtype).view(k, nb, block)
    mat2.copy_(blocked.transpose(0, 1))
    return mat2.view(k, nb * block)[:, :n]


class BlockedLinear:
    """Instance-level ``forward`` of a linear layer (``nn.Linear``, or transformers' ``Conv1D``)
    whose weight Parameter holds :func:`block_weight`'s layout: ``x @ W.T + b`` (``x @ W + b``
    for ``Conv1D``), read from those blocks by eager and compiled code alike (fp32:
    :func:`blocked_matmul`; bf16/fp16: :func:`half_blocked_linear`, by the native op where
    :func:`native_half_ready` said so when the weight was laid out). ``plain_dtype``: the
    dtype the weight had before a storage dtype narrowed it (None: not narrowed), which the
    undo of a split (:meth:`split_views`) restores too."""

    def __init__(self, module: nn.Module, out_features: int,
                 plain_dtype: torch.dtype | None = None) -> None:
        self.module, self.out_features, self.plain_dtype = module, out_features, plain_dtype
        self.native_op = module.weight.dtype not in HALF_DTYPES or native_half_ready()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        if module.weight.dtype in HALF_DTYPES:
            return half_blocked_linear(x, module.weight, module.bias, self.out_features,
                                       self.native_op)
        out = blocked_matmul(x, module.weight, self.out_features)
        return out if module.bias is None else out + module.bias

    def split_views(self, parts: tuple[nn.Module, ...], widths: tuple[int, ...]) -> bool:
        """Lay ``parts`` out as views of this module's blocks, when this module is a fused
        projection of them (:mod:`shardwise.inject.fuse`: its output rows are the parts'
        side by side, ``widths`` each): part ``i``'s weight becomes blocks ``[b_i, b_i +
        ceil(w_i / block))`` (no copy), with a :class:`BlockedLinear` forward and a
        :class:`PlainLayoutInStateDict` hook as :func:`block_linear_weights` gives, and an undo
        that lays its plain layout out again. Needs every width but the last to fill whole
        blocks and plain ``nn.Linear`` parts; returns False (nothing changed) otherwise."""
        blocked = self.module.weight  # [Nb, K, block]
        block = blocked.shape[-1]
        if blocked.dim() != 3 or any(w % block for w in widths[:-1]) or any(
                type(p) is not nn.Linear for p in parts):
            return False
        start = 0
        for part, width in zip(parts, widths):
            count = -(-width // block)
            with torch.no_grad():
                part.weight.data = blocked.detach()[start:start + count]
            _record_blocked(part.weight, width, conv=False, plain_dtype=self.plain_dtype)
            set_forward(part, BlockedLinear(part, width, self.plain_dtype),
                        "blocked-layout forward")
            add_hook(part.register_state_dict_post_hook(PlainLayoutInStateDict(width, True)),
                     "plain-layout state_dict hook of Linear")
            start += count
        return True

    def __repr__(self) -> str:
        return f"BlockedLinear(out_features={self.out_features})"


class BlockedEmbedding:
    """Instance-level ``forward`` of an ``nn.Embedding`` whose weight (tied to an output head
    laid out by :func:`block_weight`) holds those blocks: row ``v`` is column ``v`` of the
    head's ``mat2``, i.e. ``blocks[v // BLOCK_N, :, v % BLOCK_N]``, widened to ``dtype`` when
    the blocks are stored narrower than the compute dtype (None: as stored)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype | None = None) -> None:
        self.module, self.dtype = module, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        blocks = self.module.weight  # [Nb, K, block]
        block = blocks.shape[-1]
        rows = blocks[ids // block, :, ids % block]  # [..., K]
        return rows if self.dtype is None else rows.to(self.dtype)

    def __repr__(self) -> str:
        return "BlockedEmbedding()"


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")


def gemm_like(module: nn.Module) -> bool:
    """A module whose forward is a matrix product: a 2-d weight that is not an embedding table,
    or a linear of another kind (e.g. a quantized one: ``in_features``/``out_features`` and a
    packed weight, lowered by inductor through its GEMM selection like any ``mm``)."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return False
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2:
        return True
    return (isinstance(getattr(module, "in_features", None), int)
            and isinstance(getattr(module, "out_features", None), int))


def _blockable(module: nn.Module, weight_dtype: torch.dtype | None = None) -> bool:
    """A plain fp32 linear on the CPU, with no forward of its own (not already patched), or a
    bf16/fp16 one where the native kernel that reads 16-bit blocks builds
    (:func:`native_half_ready`). With a storage dtype (``weight_dtype``): fp32 ones only."""
    if "forward" in module.__dict__ or not (type(module) is nn.Linear or _is_conv1d(module)):
        return False
    w = getattr(module, "weight", None)
    if not (isinstance(w, torch.Tensor) and w.dim() == 2 and w.device.type == "cpu"):
        return False
    if weight_dtype is not None:
        return w.dtype == torch.float32
    return w.dtype == torch.float32 or (w.dtype in HALF_DTYPES and native_half_ready())


def native_half_ready() -> bool:
    """Whether 16-bit weights are laid out in blocks: the native kernel that reads them builds
    on this machine and the native CPU kernels are not opted out
    (:mod:`shardwise.kernels.cpu.native`); otherwise they keep their layout and the compiled
    row product (:mod:`~shardwise.accelerators.cpu_gemv`)."""
    from shardwise.kernels.cpu import native

    return native.load()


def block_linear_weights(linears: list[nn.Module], embedding: nn.Module | None = None,
                         weight_dtype: torch.dtype | None = None) -> int:
    """Lay out the weights of ``linears`` (the modules the decode step calls) for the C++ GEMM
    template, in place and instance-scoped: each weight Parameter's data becomes
    :func:`block_weight` of it and the module gets a :class:`BlockedLinear` forward. The old
    layout is freed (unless something else holds it), so eager and compiled code read one copy.
    ``embedding``: an ``nn.Embedding`` sharing its weight with one of ``linears`` (a tied output
    head); it gets a :class:`BlockedEmbedding` forward, or, when it cannot, that linear is left
    as it is. Modules that are not plain ``nn.Linear``/``Conv1D`` with an fp32 weight (or a
    16-bit one: :func:`_blockable`) are left as they are.
    ``weight_dtype`` (bf16 or fp16, a storage dtype): the fp32 weights are laid out in it,
    each rounded once, and run under fp32 activations (:func:`half_blocked_linear`); a tied
    embedding's rows are widened back to fp32 as they are looked up.
    Each laid-out module gets a :class:`PlainLayoutInStateDict` hook, so its ``state_dict``
    (and ``save_pretrained``) still holds the usual layout (in the dtype stored). Returns the
    number of linears laid out.

    Inside ``init_inference`` (a ledger recording: :mod:`shardwise.ledger`) every change is
    recorded — the forwards, the hooks, and each weight's new layout with an undo that lays the
    plain one out again from the blocked tensor (:func:`relay_plain_weight`; widened back to
    fp32 after a storage dtype) — so undoing needs no copy of the weights as they were."""
    tied = embedding.weight if embedding is not None else None
    done = 0
    for module in linears:
        if not _blockable(module, weight_dtype):
            continue
        w = module.weight
        if tied is not None and w is tied and not _embedding_blockable(embedding, module):
            continue
        conv = _is_conv1d(module)
        plain_dtype = w.dtype if weight_dtype is not None else None
        n = _lay_out_blocked(w, conv, weight_dtype)
        set_forward(module, BlockedLinear(module, n, plain_dtype), "blocked-layout forward")
        hook = PlainLayoutInStateDict(n, transpose=not conv)
        add_hook(module.register_state_dict_post_hook(hook),
                 f"plain-layout state_dict hook of {type(module).__name__}")
        if tied is not None and w is tied:
            set_forward(embedding, BlockedEmbedding(embedding, plain_dtype),
                        "blocked-layout forward")
            add_hook(embedding.register_state_dict_post_hook(
                PlainLayoutInStateDict(n, transpose=True)),
                "plain-layout state_dict hook of Embedding")
        done += 1
    return done


def _lay_out_blocked(weight: nn.Parameter, conv: bool,
                     weight_dtype: torch.dtype | None = None) -> int:
    """Re-point ``weight``'s data to :func:`block_weight` of its product operand (``Conv1D``'s
    [K, N] as it is, a linear's [N, K] transposed), in ``weight_dtype`` when given (rounded
    once), recorded with the undo that lays the plain layout out again from what the weight
    then holds. Returns N (the output width)."""
    mat2 = weight.detach() if conv else weight.detach().t()  # [K, N]
    n = mat2.shape[1]
    plain_dtype = None if weight_dtype is None else weight.dtype
    with torch.no_grad():  # narrowed before blocking: no second full-width copy
        weight.data = block_weight(mat2 if weight_dtype is None else mat2.to(weight_dtype))
    _record_blocked(weight, n, conv, plain_dtype)
    return n


def _record_blocked(weight: nn.Parameter, n: int, conv: bool,
                    plain_dtype: torch.dtype | None = None) -> None:
    """Record that ``weight`` (N = ``n``) now holds blocks, with the undo that lays the plain
    layout out again from them (:func:`relay_plain_weight`), widened back to ``plain_dtype``
    when a storage dtype narrowed it."""
    blocked = (weight.data_ptr(), tuple(weight.shape))  # no reference: the undo holds no tensor
    how = ("exactly" if plain_dtype is None else
           f"stored as {str(weight.dtype).removeprefix('torch.')}: widened back to "
           f"{str(plain_dtype).removeprefix('torch.')}, the rounding kept (lossy)")
    record(f"linear weight ({weight.shape[1]} in, {n} out) laid out in blocks of "
           f"{weight.shape[2]} columns (re-laid from the blocks, {how})",
           lambda: relay_plain_weight(weight, n, conv, blocked, plain_dtype))


def relay_plain_weight(weight: nn.Parameter, n: int, conv: bool,
                       blocked: tuple[int, tuple[int, ...]] | None = None,
                       plain_dtype: torch.dtype | None = None) -> bool:
    """:func:`block_linear_weights`'s undo for one weight: its data laid out plainly again —
    [K, N] for ``Conv1D``, [N, K] (contiguous) for a linear or a tied embedding — from the
    blocks it holds (bit for bit: the layout moves values, it never computes them; in
    ``plain_dtype`` when given, the widening of a storage dtype, exact from what is stored).
    The blocked tensor is freed as the plain one replaces it: at most one weight's two layouts
    exist at once. ``blocked``: (data pointer, shape) the weight held once laid out; if it holds
    anything else by now (something restored it already), it is left as it is. Returns whether
    it was re-laid."""
    if blocked is not None and (weight.data_ptr(), tuple(weight.shape)) != blocked:
        return False
    if conv:
        plain = unblock_weight(weight.data, n)  # [K, N]
    else:
        nb, k, block = weight.shape
        plain = weight.detach().transpose(1, 2).reshape(nb * block, k)[:n]  # [N, K], contiguous
    if plain_dtype is not None:
        plain = plain.to(plain_dtype)
    with torch.no_grad():
        weight.data = plain
    return True


def _embedding_blockable(embedding: nn.Module, head: nn.Module) -> bool:
    return (type(embedding) is nn.Embedding and "forward" not in embedding.__dict__
            and type(head) is nn.Linear and embedding.max_norm is None)
