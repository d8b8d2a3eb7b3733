"""The kernel parity matrix: every (op, backend) the registry holds against the torch reference.

One table of cases per op (``CASES``); each case names the targets and dtypes it runs in:

* ``cpu``: the ``cpu`` backend's implementation, on CPU tensors;
* ``triton``: the ``triton`` backend's kernels called directly, under ``TRITON_INTERPRET=1`` on
  the CPU (conftest sets it when there is no GPU; tiny shapes, each program costs ms
  interpreted) or on the GPU when there is one;
* ``cuda`` (``gpu`` marker, skipped without a GPU): the op resolved through the registry for the
  installed cuda accelerator, which must pick ``triton``, at model sizes.

The reference is the oracle side of every case (its own checks against HF and float64 are in
tests/test_kernels_reference.py). ``test_bad_input_raises_like_the_reference`` runs the
reference too: every backend refuses what it refuses, with the same error.
``test_every_registered_kernel_has_cases`` keeps the matrix from shrinking: a built-in backend
that registers an op, or a dtype of one, without a case here fails it. Tolerances per dtype are
in tests/kernel_inputs.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch

from gpu import cuda_accelerator
from hpu_standin import standin  # noqa: F401 (the hpu target's fixture)
from kernel_inputs import (DECODE_LENGTHS, DECODE_STARTS, QUANT_SPECS, TOL, assert_moe_matches,
                           assert_quant_matches, check_norm, dtype_id, garbage_cache, heads,
                           moe_inputs, norm_inputs,
                           padding_mask, positions, qkv, quant_weight, quant_x, randn,
                           window_starts, write_case)
from shardwise import KernelError
from shardwise.kernel_registry import REFERENCE, KernelRegistry
from shardwise.kernels.reference.attention import alibi_slopes
from shardwise.kernels.reference.quant import expert_spec, quantize_weight
from shardwise.kernels.reference.quant import quantize_experts as quant_experts
from shardwise.kernels.reference.rotary import ROTARY_STYLES, rotary_cos_sin
from shardwise.plugins import kernel_plugins

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
ALL = (F32, BF16, F16)
HALF = (F16, BF16)  # the GPU cases' dtypes
#: target -> the backend whose implementations it runs
BACKEND_OF = {"cpu": "cpu", "triton": "triton", "cuda": "triton", "hpu": "hpu"}
#: the ``hpu`` target: the Gaudi kernels over the bridge stand-in's hpex ops (tests/fake_habana),
#: on CPU tensors (the stand-in's fused ops compute with torch), in the CPU cases' shapes


@dataclass(frozen=True)
class Call:
    """One call of an op: the same ``args``/``kwargs`` go to the backend and the reference.

    ``ref_args`` replaces the reference's args (e.g. without the NaN a backend must never read
    but the reference's full softmax would); ``backend_kwargs`` go to the backend only (e.g. a
    forced split count); ``resolve`` are the shape keywords a ``cuda`` case resolves with;
    ``bind(kernel, args) -> args`` adapts the args to each implementation (quant: prepack).
    """

    args: tuple
    kwargs: dict = field(default_factory=dict)
    ref_args: tuple | None = None
    backend_kwargs: dict = field(default_factory=dict)
    resolve: dict = field(default_factory=dict)
    bind: Callable[[Any, tuple], tuple] | None = None


@dataclass(frozen=True)
class Ctx:
    """What a check needs to know about the run."""

    call: Call
    args: tuple  # as the backend got them (after bind)
    dtype: torch.dtype
    target: str
    device: str


@dataclass(frozen=True)
class Case:
    """A case of ``op``: ``build(dtype, device, target)`` returns its calls, ``check(got, want,
    ctx)`` compares each; ``dtypes`` maps the targets it runs on to their dtypes; ``kernel(fn,
    device)`` may swap the registered kernel for a configured instance of it (small tiles)."""

    op: str
    name: str
    build: Callable[[torch.dtype, str, str], list[Call]]
    dtypes: dict[str, tuple[torch.dtype, ...]]
    check: Callable[[Any, Any, Ctx], None]
    kernel: Callable[[Any, str], Any] | None = None
    inplace: bool = False  # the op writes its args: the reference gets copies


# ----- checks ---------------------------------------------------------------------------------


def close(got, want, ctx: Ctx) -> None:
    """Tensors (or tuples of them) within TOL of the reference, same dtype and shape."""
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        torch.testing.assert_close(g, w, **TOL[ctx.dtype])


def exact(got, want, ctx: Ctx) -> None:
    """Bit for bit (same roundings, or a copy)."""
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


def norm_check(got, want, ctx: Ctx) -> None:
    """The norms' (out, h): out within TOL, h exact (x itself without a residual). The
    interpreter rounds float32 → bf16 by truncation (a GPU rounds to nearest even), so its bf16
    ``h`` may be one unit in the last place (2**-7 relative) off torch's ``x + r``."""
    x, residual = ctx.args[0], ctx.call.kwargs.get("residual")
    h_tol = None
    if ctx.target == "triton" and ctx.device == "cpu" and ctx.dtype == BF16:
        h_tol = dict(atol=0.0, rtol=2.0**-7)
    check_norm(got, want, x, residual, h_tol)


def decode_check(got, want, ctx: Ctx) -> None:
    """Within TOL, and a sequence of length 0 gives exact zeros (never NaN)."""
    close(got, want, ctx)
    lengths = ctx.args[3]
    assert got[lengths == 0].eq(0).all()


def chunks_check(got, want, ctx: Ctx) -> None:
    """Within TOL, and the padding tokens after the chunks are exact zeros."""
    close(got, want, ctx)
    used = int(ctx.args[3][:, 2].sum())
    assert got[:, :, used:].eq(0).all()


def relu_check(exact_on: set[str]):
    def check(got, want, ctx: Ctx) -> None:
        (exact if ctx.target in exact_on else close)(got, want, ctx)
        assert got.eq(0).any()  # the relu clipped something
    return check


def quant_check(got, want, ctx: Ctx) -> None:
    assert_quant_matches(got.cpu(), want.cpu(), ctx.dtype)


# ----- norms ----------------------------------------------------------------------------------

NORM_SHAPES = {"cpu": [(1, 33), (3, 64), (7, 100), (2, 3, 100)],  # [..., hidden], ragged
               "triton": [(1, 17), (3, 64), (2, 2, 96)]}  # tiny: interpreted
HPU_NORMS = ("rms_norm",)  # the Gaudi stack fuses RMSNorm only (hpex FusedRMSNorm)
NORM_GPU = [(rows, hidden) for hidden in (4096, 8192) for rows in (1, 7, 64)]


def _norm_build(op, shape, with_residual, with_bias, params_dtype=None):
    def build(dtype, device, target):
        x, residual, weight, bias = norm_inputs(shape, dtype, device)
        if params_dtype is not None:  # e.g. float32 weights with bf16 activations
            weight, bias = weight.to(params_dtype), bias.to(params_dtype)
        bias = bias if with_bias else None
        args = (x, weight, 1e-5) if op == "rms_norm" else (x, weight, bias, 1e-5)
        return [Call(args, {"residual": residual if with_residual else None},
                     resolve={"hidden": shape[-1]})]
    return build


def _norm_strided(op):
    """Rows with a pitch (views into a wider buffer) and a residual whose last dim is not
    contiguous."""
    def build(dtype, device, target):
        wide, _, weight, bias = norm_inputs((3, 40), dtype, device)
        x = wide[:, :24]  # [3, 24], row stride 40: launched in place
        residual = norm_inputs((24, 3), dtype, device, seed=1)[0].t()  # [3, 24], stride (1, 3)
        weight, bias = weight[:24], bias[:24]
        args = (x, weight, 1e-5) if op == "rms_norm" else (x, weight, bias, 1e-5)
        return [Call(args, {"residual": residual})]
    return build


def _norm_cases(op):
    biases = (True, False) if op == "layer_norm" else (False,)
    for target, shapes in NORM_SHAPES.items():
        for shape, res, bias in itertools.product(shapes, (True, False), biases):
            name = f"{target}-shape{'x'.join(map(str, shape))}-res{int(res)}"
            name += f"-bias{int(bias)}" if op == "layer_norm" else ""
            also = {"hpu": ALL} if op in HPU_NORMS and target == "cpu" else {}
            yield Case(op, name, _norm_build(op, shape, res, bias), {target: ALL, **also},
                       norm_check)
    yield Case(op, "f32-params", _norm_build(op, (3, 40), True, True, F32), {"cpu": (BF16,)},
               norm_check)
    yield Case(op, "strided", _norm_strided(op), {"triton": (F32,)}, norm_check)
    for (rows, hidden), res in itertools.product(NORM_GPU, (True, False)):
        yield Case(op, f"gpu-{rows}x{hidden}-res{int(res)}",
                   _norm_build(op, (rows, hidden), res, True), {"cuda": HALF}, norm_check)
    yield Case(op, "gpu-leading-dims", _norm_build(op, (2, 32, 4096), True, True),
               {"cuda": (BF16,)}, norm_check)


# ----- rotary ---------------------------------------------------------------------------------


def _rotary_build(batch, q_heads, kv_heads, seq, d, rotary_dim, style, shared=False):
    def build(dtype, device, target):
        q, k, _ = qkv(batch, q_heads, kv_heads, seq, seq, d, dtype, device)
        cos, sin = rotary_cos_sin(positions(batch, seq, device), rotary_dim)
        if shared:  # one [1, seq, rotary_dim/2] table broadcast over the batch
            cos, sin = cos[:1], sin[:1]
        return [Call((q, k, cos, sin), {"style": style}, resolve={"head_dim": d})]
    return build


def _rotary_cases():
    for style in ROTARY_STYLES:
        for rotary_dim in (24, 10):  # head_dim 24: full and partial
            yield Case("rotary", f"seq5-r{rotary_dim}-{style}",
                       _rotary_build(2, 4, 2, 5, 24, rotary_dim, style),
                       {"cpu": ALL, "hpu": ALL}, close)
        for rotary_dim, shared in itertools.product((24, 8), (False, True)):
            yield Case("rotary", f"seq3-r{rotary_dim}-{style}" + "-shared-cos" * shared,
                       _rotary_build(2, 4, 2, 3, 24, rotary_dim, style, shared),
                       {"triton": ALL}, close)
    for style, rotary_dim in (("half", 128), ("half", 32), ("interleaved", 64)):
        yield Case("rotary", f"gpu-{style}-r{rotary_dim}",
                   _rotary_build(4, 32, 8, 512, 128, rotary_dim, style), {"cuda": HALF}, close)


# ----- activations ----------------------------------------------------------------------------

#: target -> the activations' x shape: cpu ragged, triton 2 column blocks of 1024, GPU an MLP
ACT_SHAPES = {"cpu": (3, 5, 40), "triton": (2, 3, 1100), "cuda": (64, 2 * 11008)}


def _act_build(op, target_shape, with_bias, approximate=None, strided=False):
    def build(dtype, device, target):
        shape = target_shape
        x = randn(*shape, dtype=dtype, device=device, scale=3)
        bias = randn(shape[-1], dtype=dtype, device=device, seed=1) if with_bias else None
        if strided:  # a non-unit column stride (copied first by the triton launcher)
            x, bias = x[..., ::2], None
        args = (x, bias) if approximate is None else (x, bias, approximate)
        return [Call(args)]
    return build


def _silu_build(shape, split):
    def build(dtype, device, target):
        x = randn(*shape, dtype=dtype, device=device, scale=3)
        return [Call(x.chunk(2, -1) if split else (x,))]
    return build


def _activation_cases():
    for target, shape in ACT_SHAPES.items():
        dtypes = {target: HALF if target == "cuda" else ALL}
        for approximate, bias in itertools.product(("none", "tanh"), (True, False)):
            if target == "cuda" and not bias:
                continue
            yield Case("bias_gelu", f"{target}-{approximate}-bias{int(bias)}",
                       _act_build("bias_gelu", shape, bias, approximate), dtypes, close)
        for bias in (True, False):  # cpu: the same roundings as the reference, bit for bit
            yield Case("bias_relu", f"{target}-bias{int(bias)}",
                       _act_build("bias_relu", shape, bias), dtypes, relu_check({"cpu"}))
    yield Case("bias_relu", "triton-strided", _act_build("bias_relu", ACT_SHAPES["triton"],
                                                         False, strided=True),
               {"triton": ALL}, close)
    for target, shape in (("cpu", (3, 5, 72)), ("triton", (3, 2, 80))):
        for split in (False, True):
            yield Case("silu_and_mul", f"{target}-{'split' if split else 'fused'}",
                       _silu_build(shape, split), {target: ALL}, close)
    yield Case("silu_and_mul", "gpu-fused", _silu_build(ACT_SHAPES["cuda"], False),
               {"cuda": HALF}, close)


# ----- attention ------------------------------------------------------------------------------

#: attention sinks for 4 heads (GPT-OSS): one dominating, one vanishing, two in the scores' range
SINKS = torch.tensor([6.0, -30.0, 0.5, -1.0])
PREFILL_CASES = {  # name: (batch, q_heads, kv_heads, q_len, kv_len, kwargs(device))
    "causal-gqa": (2, 4, 2, 13, 13, lambda dev: {}),
    "encoder-mqa": (2, 4, 1, 13, 13, lambda dev: {"causal": False}),
    "chunk": (2, 4, 2, 5, 13, lambda dev: {}),
    "padding": (3, 4, 2, 13, 13, lambda dev: {"key_padding_mask": padding_mask(3, 13, dev)}),
    "alibi": (2, 4, 4, 13, 13, lambda dev: {"alibi_slopes": alibi_slopes(4, dev)}),
    "alibi-padding-gqa": (3, 4, 2, 13, 13, lambda dev: {
        "alibi_slopes": alibi_slopes(4, dev), "key_padding_mask": padding_mask(3, 13, dev)}),
    "window-gqa": (2, 4, 2, 13, 13, lambda dev: {"window": 4}),
    "window-1-mqa": (2, 4, 1, 13, 13, lambda dev: {"window": 1}),
    "window-wide": (2, 4, 2, 13, 13, lambda dev: {"window": 13}),  # every key: plain causal
    "window-chunk": (2, 4, 2, 5, 13, lambda dev: {"window": 6}),
    "window-chunk-long": (2, 4, 2, 5, 80, lambda dev: {"window": 8}),  # Triton skips a tile
    "window-padding-alibi-gqa": (3, 4, 2, 13, 13, lambda dev: {
        "window": 5, "alibi_slopes": alibi_slopes(4, dev),
        "key_padding_mask": padding_mask(3, 13, dev)}),
    "sinks-window-gqa": (2, 4, 2, 13, 13, lambda dev: {"window": 4, "sinks": SINKS.to(dev)}),
    "sinks-padding-chunk-mqa": (3, 4, 1, 5, 13, lambda dev: {
        "key_padding_mask": padding_mask(3, 13, dev), "sinks": SINKS.to(dev)}),
}
GPU_PREFILL = ["causal-gqa", "padding-alibi", "encoder", "window-gqa", "window-padding-alibi",
               "sinks-window-gqa"]


def _prefill_build(batch, q_heads, kv_heads, q_len, kv_len, kwargs, d=24):
    def build(dtype, device, target):
        q, k, v = qkv(batch, q_heads, kv_heads, q_len, kv_len, d, dtype, device)
        return [Call((q, k, v), kwargs(device), resolve={"head_dim": d})]
    return build


def _prefill_skips_tiles(dtype, device, target):
    """Queries 75..79 with window 8 see keys 68..79: the key tile(s) before 64 are never read
    (NaN there would poison P @ V); the reference, which reads every key, gets clean ones."""
    q, k, v = qkv(2, 4, 2, 5, 80, 24, dtype, device)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, :64], v_bad[:, :, :64] = float("nan"), float("nan")
    return [Call((q, k_bad, v_bad), {"window": 8}, ref_args=(q, k, v))]


def _gpu_prefill_build(case, seq):
    def build(dtype, device, target):
        batch, gqa = 2, case.endswith("gqa")
        q, k, v = qkv(batch, 32, 8 if gqa else 32, seq, seq, 128, dtype, device)
        kw = {"causal": case != "encoder"}
        if "padding-alibi" in case:
            kw.update(key_padding_mask=padding_mask(batch, seq, device),
                      alibi_slopes=alibi_slopes(32, device))
        if "window" in case:  # 256 (Mistral-like, tile-aligned), 100 (not aligned)
            kw["window"] = 256 if gqa else 100
        if "sinks" in case:
            kw["sinks"] = randn(32, device=device, seed=9)
        return [Call((q, k, v), kw, resolve={"head_dim": 128})]
    return build


#: (kv_heads, alibi, starts, window): cpu runs every one; triton the first three (splits)
DECODE_CASES = [(2, False, False, None), (1, True, True, None), (4, False, True, None),
                (4, False, False, None), (2, True, True, None), (1, False, True, None),
                (1, True, False, None),
                # window starts mid-split (15, 20), in the last split (32), or beyond the cache
                (2, False, False, 8), (1, True, True, 20), (4, False, True, 1),
                (2, True, False, 100)]
TRITON_DECODE = {0, 1, 2, 7, 8, 9, 10}
#: attention sinks: (kv_heads, starts, window); cpu and triton (in the reduction of 3 splits)
SINK_DECODE = [(2, True, 8), (1, False, None), (4, True, None)]
#: the interpreter's decode: 40 tokens in splits of 16 (3 splits, the last one partial; length
#: 23 ends mid-split, start 17 begins in the second)
SPLITS = {"num_splits": 3, "block_n": 16}


def _decode_build(kv_heads, alibi, starts, window, same=False, sinks=False):
    def build(dtype, device, target):
        q = heads(4, 4, 1, 24, dtype, device)
        lengths, firsts = DECODE_LENGTHS, DECODE_STARTS if starts else None
        if same:  # every sequence the same range: the cpu backend's one-call path
            lengths, firsts = [17] * 4, [2] * 4
        garbage_from = window_starts(lengths, firsts, window)  # garbage before each window
        k_cache, v_cache = garbage_cache(4, kv_heads, 40, 24, lengths, dtype, device,
                                         garbage_from)
        kw = {"alibi_slopes": alibi_slopes(4, device) if alibi else None, "window": window}
        if firsts:
            kw["starts"] = torch.tensor(firsts, device=device)
        if sinks:
            kw["sinks"] = SINKS.to(device)
        n = torch.tensor(lengths, device=device, dtype=torch.int32 if target == "triton"
                         else torch.int64)
        return [Call((q, k_cache, v_cache, n), kw,
                     backend_kwargs=SPLITS if target == "triton" else {})]
    return build


def _decode_default_split(dtype, device, target):
    q = heads(2, 4, 1, 32, dtype, device)
    k_cache, v_cache = garbage_cache(2, 2, 36, 32, [36, 5], dtype, device)
    return [Call((q, k_cache, v_cache, torch.tensor([36, 5], device=device)))]


#: a served mixed step's chunks (slot, past, n): three chunks over rows 2, 0 and 3 of 4 (row 1
#: has none), then one padding token
CHUNK_SPANS = [[2, 10, 5], [0, 0, 4], [3, 30, 2], [0, 0, 0]]


def _chunks_build(kv_heads, option):
    def build(dtype, device, target):
        spans = torch.tensor(CHUNK_SPANS, device=device)
        lengths = [0] * 4  # positions a row's chunk sees: garbage (NaN keys) past them
        for slot, past, n in CHUNK_SPANS:
            lengths[slot] = max(lengths[slot], past + n)
        q = heads(1, 4, 12, 24, dtype, device)
        k_cache, v_cache = garbage_cache(4, kv_heads, 40, 24, lengths, dtype, device)
        kw = {"window": {"window": 6}, "alibi": {"alibi_slopes": alibi_slopes(4, device)},
              "sinks": {"sinks": SINKS.to(device)}, "scale": {"scale": 0.3}, None: {}}[option]
        return [Call((q, k_cache, v_cache, spans), kw,
                     backend_kwargs=SPLITS if target == "triton" else {})]
    return build


def _gpu_chunks_build(dtype, device, target):
    """A 1B-Llama-sized mixed step's chunks: 32/8 heads of 128 over 2048 positions, a 200-token
    chunk after 1500 cached ones, one of 56 starting a slot, then padding to 512."""
    spans = [[5, 1500, 200], [1, 0, 56], [0, 0, 0], [0, 0, 0]]
    lengths = [0] * 8
    lengths[5], lengths[1] = 1700, 56
    q = heads(1, 32, 512, 128, dtype, device)
    k_cache, v_cache = garbage_cache(8, 8, 2048, 128, lengths, dtype, device)
    return [Call((q, k_cache, v_cache, torch.tensor(spans, device=device)), {},
                 resolve={"head_dim": 128})]


def _gpu_decode_build(batch, kv_heads, alibi, window, sinks=False):
    def build(dtype, device, target):
        g = torch.Generator().manual_seed(batch)
        lengths = torch.randint(1, 4097, (batch,), generator=g).tolist()
        lengths[0] = 4096
        starts = [n // 3 if b % 2 else 0 for b, n in enumerate(lengths)]  # some left padding
        q = heads(batch, 32, 1, 128, dtype, device)
        firsts = window_starts(lengths, starts, window)  # garbage before each window too
        k_cache, v_cache = garbage_cache(batch, kv_heads, 4096, 128, lengths, dtype, device,
                                         firsts)
        lens = torch.tensor(lengths, device=device, dtype=torch.int32)
        kw = {"starts": torch.tensor(starts, device=device), "window": window}
        if alibi:
            kw["alibi_slopes"] = alibi_slopes(32, device)
        if sinks:
            kw["sinks"] = randn(32, device=device, seed=9)
        return [Call((q, k_cache, v_cache, lens), kw, resolve={"head_dim": 128})]
    return build


def _attention_cases():
    for name, (b, qh, kvh, ql, kvl, kw) in PREFILL_CASES.items():  # cuda too: small heads
        yield Case("attention_prefill", name, _prefill_build(b, qh, kvh, ql, kvl, kw),
                   {"cpu": ALL, "triton": (F32, BF16), "cuda": ALL, "hpu": ALL}, close)
    yield Case("attention_prefill", "head-dim-16", _prefill_build(2, 4, 2, 16, 16,  # tiny models'
                                                                  lambda dev: {}, d=16),
               {"cpu": ALL, "triton": (F32, BF16), "cuda": ALL, "hpu": ALL}, close)
    yield Case("attention_prefill", "window-skips-key-tiles", _prefill_skips_tiles,
               {"triton": (F32, BF16)}, close)
    for case, seq in itertools.product(GPU_PREFILL, (1, 333, 2048)):
        yield Case("attention_prefill", f"gpu-{case}-seq{seq}", _gpu_prefill_build(case, seq),
                   {"cuda": HALF}, close)
    for i, (kvh, alibi, starts, window) in enumerate(DECODE_CASES):
        name = f"kv{kvh}-alibi{int(alibi)}-starts{int(starts)}-window{window}"
        dtypes = {"cpu": ALL, **({"triton": (F32, BF16), "cuda": ALL} if i in TRITON_DECODE
                                 else {})}
        yield Case("attention_decode", name, _decode_build(kvh, alibi, starts, window), dtypes,
                   decode_check)
        if window is None:
            yield Case("attention_decode", f"same-ranges-{name}",
                       _decode_build(kvh, alibi, starts, None, same=True), {"cpu": ALL}, close)
    yield Case("attention_decode", "default-split", _decode_default_split,
               {"cpu": ALL, "triton": (F32,)}, close)
    for kvh, starts, window in SINK_DECODE:  # attention sinks (GPT-OSS)
        yield Case("attention_decode", f"sinks-kv{kvh}-starts{int(starts)}-window{window}",
                   _decode_build(kvh, False, starts, window, sinks=True),
                   {"cpu": ALL, "triton": (F32, BF16)}, decode_check)
    yield Case("attention_decode", "sinks-same-ranges", _decode_build(2, False, True, None, True,
                                                                      sinks=True),
               {"cpu": ALL}, close)
    for kvh, option in itertools.product((2, 1), (None, "window", "alibi", "sinks", "scale")):
        yield Case("attention_chunks", f"kv{kvh}-{option or 'plain'}", _chunks_build(kvh, option),
                   {"cpu": ALL, "triton": (F32, BF16), "cuda": ALL}, chunks_check)
    yield Case("attention_chunks", "gpu-llama-1b", _gpu_chunks_build, {"cuda": HALF},
               chunks_check)
    for batch, kvh, alibi, window in itertools.product((1, 4, 16), (8, 1), (False, True),
                                                       (None, 1000)):
        yield Case("attention_decode", f"gpu-b{batch}-kv{kvh}-alibi{int(alibi)}-w{window}",
                   _gpu_decode_build(batch, kvh, alibi, window), {"cuda": HALF}, decode_check)
    for batch, window in itertools.product((1, 16), (None, 128)):
        yield Case("attention_decode", f"gpu-b{batch}-kv8-sinks-w{window}",
                   _gpu_decode_build(batch, 8, False, window, sinks=True), {"cuda": HALF},
                   decode_check)


# ----- kv cache -------------------------------------------------------------------------------


def _write_build(positions_):
    def build(dtype, device, target):
        (k_cache, v_cache), (k_new, v_new) = write_case(dtype, device)
        pos = (torch.tensor(positions_, device=device) if isinstance(positions_, list)
               else positions_)
        return [Call((k_cache, v_cache, k_new, v_new, pos))]
    return build


def _gpu_write(dtype, device, target):
    caches = [randn(16, 8, 4096, 128, dtype=dtype, device=device, seed=s) for s in (0, 1)]
    new = [randn(16, 8, 1, 128, dtype=dtype, device=device, seed=s) for s in (2, 3)]
    pos = torch.randint(0, 4096, (16,), device=device)
    return [Call((*caches, *new, pos))]


def _kv_cache_cases():
    for pos, dtypes in ((4, {"cpu": ALL, "triton": (BF16, F32)}),
                        ([0, 7], {"cpu": ALL, "triton": (BF16,)}),
                        ([3, 3], {"cpu": ALL})):  # tensor positions, all equal: one slice
        name = f"positions-{'-'.join(map(str, pos)) if isinstance(pos, list) else pos}"
        yield Case("kv_cache_write", name, _write_build(pos), dtypes, exact, inplace=True)
    yield Case("kv_cache_write", "gpu-decode-b16", _gpu_write, {"cuda": HALF}, exact,
               inplace=True)


# ----- quant ----------------------------------------------------------------------------------


def _prepacker():
    """bind: (x, QuantizedWeight, bias) → (x, the weight packed by ``kernel``, bias), packing
    once per kernel for all the calls of one build (as a model packs once at load)."""
    packed = {}

    def bind(kernel, args):
        x, qw, bias = args
        key = (id(kernel), x.device, x.dtype)
        if key not in packed:
            packed[key] = kernel.prepack(qw.to(x.device), x.device, x.dtype)
        return x, packed[key], bias
    return bind


def _quant_build(in_features, out_features, group_size, bits, symmetric, xs,
                 biases=(False, True)):
    """Calls of a quantized [out, in] weight on each x of ``xs(dtype, device)``, without and with
    a bias (``biases``)."""
    def build(dtype, device, target):
        qw = quantize_weight(quant_weight(out_features, in_features), bits, group_size,
                             symmetric)
        bias = quant_x((out_features,), dtype, device, seed=2)
        bind = _prepacker()
        return [Call((x, qw, bias if b else None), resolve=qw.spec.as_shape(), bind=bind)
                for x in xs(dtype, device) for b in biases]
    return build


def _rows(*shape):
    """xs: one contiguous x of ``shape``."""
    return lambda dtype, device: [quant_x(shape, dtype, device)]


def _strided_columns(dtype, device):
    """[2, 3, 128] with a last-dim stride of 2."""
    return [quant_x((2, 3, 256), dtype, device)[..., ::2]]


def _row_pitch(dtype, device):
    """Rows with a pitch of 100: 2 rows (GEMV) and 10 rows (GEMM) of 64 features."""
    wide = quant_x((2, 5, 100), dtype, device)
    return [wide[:, :1, :64], wide[:, :, :64]]


#: cpu (in, out, group): int4 runs all but group 16 (its kernel's groups are 32..256)
CPU_QUANT = [(64, 48, 16), (64, 48, 32), (64, 96, -1), (128, 48, 64), (128, 96, -1),
             (256, 48, 128)]
#: triton (rows, in, group, kernel): GEMV with 1 and 3 rows, split-K (2 splits), GEMM with 9/10
#: rows, the weight dequantized once then torch.mm ("dequant", from 4 rows here). A group that is a multiple of the K tile takes one scale per row per tile (64/16,
#: 96/16, 128/64); group 24 is gathered per element, and in 72 then leaves a partial K tile.
#: out 48 leaves a partial N tile (block_n 32).
TRITON_QUANT = [(1, 64, 16, "gemv"), (3, 72, 24, "gemv"), (3, 96, 16, "split"),
                (9, 128, 64, "gemv"), (10, 72, 24, "gemv"), (9, 128, 64, "dequant"),
                (10, 72, 24, "dequant")]


def _triton_quant_kernel(config: str):
    """The registered Triton quant_linear's class with small blocks that accept ``device``."""
    def kernel(fn, device):
        tq = importlib.import_module(type(fn).__module__)
        gemm = tq.GemmConfig(block_m=16, block_n=32, block_k=32, num_warps=4)
        gemv = {"gemv": tq.GemvConfig(block_n=32, block_k=32, rows_x_k=64, min_block_k=16,
                                      split_k=1),
                "split": tq.GemvConfig(block_n=32, block_k=16, min_block_k=16, split_k=2)}
        if config == "dequant":
            return type(fn)(gemv["gemv"], gemm, device_types={device},
                            dequant_min_rows={8: 4, 4: 4})
        return type(fn)(gemv[config], gemm, device_types={device})
    return kernel


def _quant_cases():
    for (bits, sym), (k, n, group), rows in itertools.product(QUANT_SPECS, CPU_QUANT, (1, 3)):
        if bits == 4 and group == 16:
            continue  # refused by the cpu backend (tests/test_kernels_registry.py)
        yield Case("quant_linear", f"int{bits}-sym{int(sym)}-{k}x{n}-g{group}-rows{rows}",
                   _quant_build(k, n, group, bits, sym, _rows(rows, k)), {"cpu": (BF16, F32)},
                   quant_check)
    yield Case("quant_linear", "cpu-leading-dims-strided",
               _quant_build(128, 96, 64, 4, False, _strided_columns, (False,)),
               {"cpu": (BF16,)}, quant_check)
    for (bits, sym), (rows, k, group, config) in itertools.product(QUANT_SPECS, TRITON_QUANT):
        yield Case("quant_linear", f"int{bits}-sym{int(sym)}-rows{rows}-in{k}-g{group}-{config}",
                   _quant_build(k, 48, group, bits, sym, _rows(rows, k)), {"triton": HALF},
                   quant_check, kernel=_triton_quant_kernel(config))
    yield Case("quant_linear", "triton-row-pitch",
               _quant_build(64, 48, 16, 4, False, _row_pitch, (False,)),
               {"triton": (F16,)}, quant_check, kernel=_triton_quant_kernel("gemv"))
    for (bits, sym), group, rows in itertools.product(QUANT_SPECS, (128, -1), (1, 4, 16, 64, 256)):
        yield Case("quant_linear", f"gpu-int{bits}-sym{int(sym)}-g{group}-rows{rows}",
                   _quant_build(4096, 4096, group, bits, sym, _rows(rows, 4096), (True,)),
                   {"cuda": HALF}, quant_check)
    yield Case("quant_linear", "gpu-leading-dims-split-k",
               _quant_build(4096, 11008, 128, 4, False, lambda dtype, device: [
                   quant_x(shape, dtype, device)
                   for shape in ((1, 1, 4096), (2, 3, 4096), (2, 40, 4096))], (False,)),
               {"cuda": (BF16,)}, quant_check)


# ----- moe ------------------------------------------------------------------------------------


def moe_check(got, want, ctx: Ctx) -> None:
    assert_moe_matches(got, want, ctx.dtype)


def route_check(got, want, ctx: Ctx) -> None:
    """The same experts in the same order, float32 weights within 1e-5."""
    assert torch.equal(got[1], want[1])
    assert got[0].dtype == want[0].dtype == F32
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)


def _moe_build(tokens, hidden, inter, n_experts, top_k, adversarial=False, gpt_oss=False,
               remote=False):
    def build(dtype, device, target):
        x, gate_up, down, experts, weights = moe_inputs(tokens, hidden, inter, n_experts, top_k,
                                                        dtype, device, adversarial=adversarial,
                                                        remote=remote)
        n_experts_here = gate_up.shape[0]
        kwargs = {}
        if gpt_oss:  # expert biases and the clamped SwiGLU (limit low enough to bite)
            kwargs = dict(gate_up_bias=randn(n_experts_here, 2 * inter, dtype=dtype,
                                             device=device, seed=7),
                          down_bias=randn(n_experts_here, hidden, dtype=dtype, device=device,
                                          seed=8),
                          clamp=0.5)
        return [Call((x, gate_up, down, experts, weights), kwargs)]
    return build


def _route_build(tokens, n_experts, top_k, kwargs):
    def build(dtype, device, target):
        logits = randn(tokens, n_experts, dtype=dtype, device=device, seed=9)
        kw = dict(kwargs)
        if "bias" in kw:
            kw["bias"] = randn(n_experts, device=device, seed=10, scale=0.1)
        return [Call((logits, top_k), kw)]
    return build


#: name -> (tokens, hidden, inter, experts, top_k, adversarial, gpt_oss, remote); decode 1 and 8
#: tokens, a prefill, all tokens to one expert, GPT-OSS's biases and clamp, an I (12) too narrow
#: for grouped_mm's 16-byte strides (the gathered path), and a rank holding half the experts (the
#: sentinel E_local for slots of the other half: they contribute nothing)
MOE_CPU = {"decode-t1": (1, 64, 32, 8, 2, False, False, False),
           "decode-t8": (8, 64, 32, 8, 2, False, False, False),
           "prefill-t40": (40, 64, 48, 8, 2, False, False, False),
           "adversarial": (24, 64, 32, 8, 2, True, False, False),
           "gpt-oss": (9, 64, 32, 4, 2, False, True, False),
           "unaligned-i12": (5, 32, 12, 4, 3, False, False, False),
           "ep-sentinel": (12, 64, 32, 8, 2, False, False, True),
           "ep-sentinel-gpt-oss": (9, 64, 32, 8, 2, False, True, True),
           "ep-sentinel-i12": (7, 32, 12, 8, 3, False, False, True)}
ROUTES = {"softmax-renorm": (8, 2, dict(renormalize=True)),
          "softmax-top3": (8, 3, dict()),
          "sigmoid-grouped-bias": (16, 4, dict(scoring="sigmoid", n_group=4, topk_group=2,
                                               bias=True, renormalize=True, scale=2.5))}


def _moe_cases():
    for name, (t, h, i, e, k, adv, oss, remote) in MOE_CPU.items():
        yield Case("moe_grouped_mlp", f"cpu-{name}", _moe_build(t, h, i, e, k, adv, oss, remote),
                   {"cpu": (F32, BF16)}, moe_check)
    for name in ("decode-t8", "adversarial", "gpt-oss", "ep-sentinel"):  # interpreted: tiny
        t, _, _, e, k, adv, oss, remote = MOE_CPU[name]
        yield Case("moe_grouped_mlp", f"triton-{name}",
                   _moe_build(3, 40, 24, e, k, adv, oss, remote), {"triton": ALL}, moe_check)
    for t in (1, 8, 64):  # Mixtral-like on a GPU
        yield Case("moe_grouped_mlp", f"gpu-t{t}", _moe_build(t, 2048, 5632, 8, 2),
                   {"cuda": HALF}, moe_check)
    for name, (e, k, kw) in ROUTES.items():
        yield Case("moe_route", f"{name}", _route_build(13, e, k, kw), {"cpu": (F32, BF16)},
                   route_check)


# ----- quant_moe_mlp (quantized experts) -----------------------------------------------------


def _quant_moe_build(name, bits, symmetric, group_size):
    """``MOE_CPU[name]``'s experts quantized (per expert rows, ``group_size``), each backend
    given them packed its own way (``bind``); the reference dequantizes them."""
    t, h, i, e, k, adv, oss, remote = MOE_CPU[name]

    def build(dtype, device, target):
        x, gate_up, down, experts, weights = moe_inputs(t, h, i, e, k, F32, device,
                                                        adversarial=adv, remote=remote)
        qgu, qdn = (quant_experts(w, bits, group_size, symmetric) for w in (gate_up, down))
        held = gate_up.shape[0]
        kwargs = {}
        if oss:  # expert biases and the clamped SwiGLU (limit low enough to bite)
            kwargs = dict(gate_up_bias=randn(held, 2 * i, dtype=dtype, device=device, seed=7),
                          down_bias=randn(held, h, dtype=dtype, device=device, seed=8),
                          clamp=0.5)

        def bind(kernel, args):
            x_, gu_, dn_, ex_, w_ = args
            return (x_, kernel.prepack(gu_, held, device, dtype),
                    kernel.prepack(dn_, held, device, dtype), ex_, w_)
        specs = (expert_spec(qgu, held), expert_spec(qdn, held))
        return [Call((x.to(dtype), qgu, qdn, experts, weights), kwargs,
                     resolve={"specs": specs}, bind=bind)]
    return build


#: quantized experts on the cpu: int8/int4 x symmetric or not, per channel (int8 symmetric),
#: groups of 16 (int8 asymmetric) or 32 (int4), over the moe decode/prefill/adversarial/GPT-OSS/
#: other-rank cases (the prefill's I = 48 has no int4 group the cpu kernel takes)
QUANT_MOE = ("decode-t1", "decode-t8", "prefill-t40", "adversarial", "gpt-oss", "ep-sentinel")


def _quant_moe_cases():
    for (bits, sym), name in itertools.product(QUANT_SPECS, QUANT_MOE):
        if bits == 4 and name == "prefill-t40":
            continue
        group = 32 if bits == 4 else (-1 if sym else 16)
        yield Case("quant_moe_mlp", f"cpu-int{bits}-sym{int(sym)}-{name}",
                   _quant_moe_build(name, bits, sym, group), {"cpu": (BF16,)}, quant_check)


CASES: list[Case] = [*_norm_cases("rms_norm"), *_norm_cases("layer_norm"), *_rotary_cases(),
                     *_activation_cases(), *_attention_cases(), *_kv_cache_cases(),
                     *_quant_cases(), *_moe_cases(), *_quant_moe_cases()]
assert len({(c.op, c.name) for c in CASES}) == len(CASES), "case names repeat within an op"


def _params():
    for case in CASES:
        for target, dtypes in case.dtypes.items():
            for dtype in dtypes:
                marks = [pytest.mark.gpu] if target == "cuda" else []
                yield pytest.param(target, case, dtype, marks=marks,
                                   id=f"{target}-{case.op}-{case.name}-{dtype_id(dtype)}")


PARAMS = list(_params())


# ----- running a case -------------------------------------------------------------------------

_REGISTRY = KernelRegistry()


def _hpu_registry(request) -> KernelRegistry:
    """A registry that loaded the ``hpu`` backend through its entry point with the bridge
    stand-in importable (a fresh one: ``_REGISTRY`` loaded it without the stand-in, when it
    registers nothing)."""
    request.getfixturevalue("standin")
    registry = KernelRegistry()
    assert registry.load_backend("hpu") == "", "the hpu backend did not load on the stand-in"
    return registry


def _implementation(case: Case, target: str, dtype: torch.dtype, call: Call, device: str,
                    request=None):
    """The backend's callable for this target: the registered function (``cpu``, ``triton``,
    ``hpu`` on the bridge stand-in) or what the registry resolves for the cuda accelerator
    (which must be triton's)."""
    if target == "hpu":
        fn = _hpu_registry(request).implementations(case.op)["hpu"].fn
    elif target == "cuda":
        impl = _REGISTRY.resolve(case.op, cuda_accelerator(dtype), dtype, **call.resolve)
        assert impl.backend == "triton", f"cuda resolved {case.op} to {impl.backend!r}"
        fn = impl.fn
    else:
        error = _REGISTRY.load_backend(target)
        assert not error, f"kernel backend {target!r} did not load: {error}"
        fn = _REGISTRY.implementations(case.op)[target].fn
    return case.kernel(fn, device) if case.kernel else fn


def _declared_math(case: Case, kernel, args: tuple):
    """The math a quantized kernel declares for its packed weights (``oracle``: the native CPU
    kernel's 8-bit activations), or None where it is the reference's."""
    oracle = getattr(kernel, "oracle", None)
    if oracle is None or case.op not in ("quant_linear", "quant_moe_mlp"):
        return None
    return oracle(args[1], args[2]) if case.op == "quant_moe_mlp" else oracle(args[1])


def _copy(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _run(case: Case, target: str, dtype: torch.dtype, device: str, request=None) -> None:
    reference = _REGISTRY.implementations(case.op)[REFERENCE].fn
    calls = case.build(dtype, device, target)
    assert all(call.resolve == calls[0].resolve for call in calls), "one spec per case"
    kernel = _implementation(case, target, dtype, calls[0], device, request)
    for call in calls:
        ref_args = call.ref_args if call.ref_args is not None else call.args
        if case.inplace:
            ref_args = _copy(ref_args)
        args = call.bind(kernel, call.args) if call.bind else call.args
        if call.bind:
            ref_args = call.bind(reference, ref_args)
        got = kernel(*args, **call.kwargs, **call.backend_kwargs)
        want = reference(*ref_args, **call.kwargs)
        declared = _declared_math(case, kernel, args)
        if declared is not None:  # a kernel declaring other numerics is held to them
            want = declared(*args, **call.kwargs)
        if case.inplace:  # compare what each implementation wrote
            assert got is None and want is None
            got = tuple(a for a in args if isinstance(a, torch.Tensor))
            want = tuple(a for a in ref_args if isinstance(a, torch.Tensor))
        case.check(got, want, Ctx(call, args, dtype, target, device))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # interpreter: sigmoid(-big)
@pytest.mark.parametrize("target,case,dtype", PARAMS)
def test_matches_reference(target, case, dtype, request):
    device = {"cpu": "cpu", "cuda": "cuda", "hpu": "cpu"}.get(target) or \
        request.getfixturevalue("triton_device")
    _run(case, target, dtype, device, request)


#: the cpu quant_linear cases, run again with torch's packed kernels (the native kernel is the
#: default where it builds, so test_matches_reference runs it)
CPU_QUANT_PARAMS = [p for p in PARAMS if p.values[0] == "cpu" and p.values[1].op == "quant_linear"
                    and p.values[2] == BF16]  # torch's packed kernels take bf16 only


@pytest.mark.parametrize("target,case,dtype", CPU_QUANT_PARAMS)
def test_cpu_quant_matches_reference_with_torchs_packed_kernels(target, case, dtype, request,
                                                                monkeypatch):
    from shardwise.kernels.cpu import native

    monkeypatch.setenv(native.ENV, "torch")
    _run(case, target, dtype, "cpu", request)


# ----- bad input: every backend raises what the reference raises -------------------------------


def _bad_prefill_window(device):
    q, k, v = qkv(1, 2, 2, 4, 4, 16, F32, device)
    return [((q, k, v), {"window": bad}, "window") for bad in (0, -3, 2.5, True)] + \
        [((q, k, v), {"causal": False, "window": 2}, "causal")]


def _bad_decode_window(device):
    q = qkv(1, 2, 2, 1, 1, 16, F32, device)[0]
    k_cache, v_cache = garbage_cache(1, 2, 8, 16, [4], F32, device)
    lengths = torch.tensor([4], device=device)
    return [((q, k_cache, v_cache, lengths), {"window": bad}, "window") for bad in (0, -1)]


def _write_past_the_end(positions_):
    def build(device):
        (k_cache, v_cache), (k_new, v_new) = write_case(F32, device)
        pos = (torch.tensor(positions_, device=device) if isinstance(positions_, list)
               else positions_)
        return [((k_cache, v_cache, k_new, v_new, pos), {}, "max_tokens=10")]
    return build


#: (op, name) -> builder(device) -> [(args, kwargs, what the KernelError says)]; the args are
#: checked unchanged afterwards (nothing written before the error)
BAD_INPUT = {
    ("attention_prefill", "bad-window"): _bad_prefill_window,
    ("attention_decode", "bad-window"): _bad_decode_window,
    **{("kv_cache_write", f"past-the-end-{pos}"): _write_past_the_end(pos)
       for pos in (8, -1, [0, 8])},
}
BAD_TARGETS = ("reference", "cpu", "triton")


@pytest.mark.parametrize("target", BAD_TARGETS)
@pytest.mark.parametrize("op,name", list(BAD_INPUT))
def test_bad_input_raises_like_the_reference(target, op, name, request):
    device = "cpu" if target != "triton" else request.getfixturevalue("triton_device")
    if target != REFERENCE:
        assert not _REGISTRY.load_backend(target)
    fn = _REGISTRY.implementations(op)[target].fn
    for args, kwargs, message in BAD_INPUT[op, name](device):
        before = _copy(args)
        with pytest.raises(KernelError, match=message):
            fn(*args, **kwargs)
        for a, b in zip(args, before):  # nothing written before the error
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


# ----- the matrix covers every registered kernel -----------------------------------------------


def _builtin_backends() -> list[str]:
    """Kernel backends shipped in shardwise itself (entry points into shardwise.kernels)."""
    return sorted(name for name, record in kernel_plugins().records.items()
                  if record.target.startswith("shardwise.kernels."))


def uncovered(registry: KernelRegistry, backends: list[str], params: list) -> list[str]:
    """What ``backends`` registered in ``registry`` that no case of ``params`` runs: an op in one
    of its dtypes (a dtype-agnostic one in fp32, bf16 and fp16), and for triton an op with no
    ``cuda`` case."""
    covered = {(p.values[1].op, BACKEND_OF[p.values[0]], p.values[2]) for p in params}
    on_gpu = {p.values[1].op for p in params if p.values[0] == "cuda"}
    missing = []
    for backend in backends:
        for op in registry.ops():
            impl = registry.implementations(op).get(backend)
            if impl is None:
                continue
            missing += [f"{op} / {backend} / {dtype_id(dtype)}"
                        for dtype in sorted(impl.dtypes or ALL, key=str)
                        if (op, backend, dtype) not in covered]
            if backend == "triton" and op not in on_gpu:
                missing.append(f"{op} / triton on a GPU (target cuda)")
    return missing


def test_every_registered_kernel_has_cases():
    """Each op a built-in backend registers, in each dtype it registers, has a case in a target
    that runs that backend; the triton backend also on a GPU (``cuda``) for each of its ops."""
    registry = KernelRegistry()
    backends = _builtin_backends()
    assert set(BACKEND_OF.values()) <= set(backends), backends
    for backend in list(backends):
        error = registry.load_backend(backend)
        if error and backend == "triton" and importlib.util.find_spec("triton") is None:
            backends.remove(backend)  # no triton here: its registrations cannot be listed
            continue
        assert not error, f"{backend}: {error}"
    missing = uncovered(registry, backends, PARAMS)
    assert not missing, f"registered kernels without a parity case: {missing}"


def test_a_kernel_without_a_case_is_reported():
    """The check above is not vacuous: a new dtype, a new op and a triton op only run by the
    interpreter are each named."""
    registry = KernelRegistry()
    assert registry.load_backend("cpu") == ""
    assert uncovered(registry, ["cpu"], PARAMS) == []
    registry.register("rotary", "cpu", lambda *a, **k: None, dtypes=[torch.float64])
    registry.register("bias_relu", "triton", lambda *a, **k: None, dtypes=[F32])
    without_gpu = [p for p in PARAMS if p.values[0] != "cuda"]
    assert sorted(uncovered(registry, ["cpu", "triton"], without_gpu)) == [
        "bias_relu / triton on a GPU (target cuda)", "rotary / cpu / float64"]


@pytest.mark.parametrize("kernel, expected", [
    ("torch", {("int8", False), ("int8", True), ("int4", False), ("int4", True)}),
    ("native", {("native", False), ("native", True)})])
def test_cpu_quant_cases_cover_every_kernel_path(kernel, expected, monkeypatch):
    """The cpu quant cases reach, with torch's packed kernels, int8 per-channel, int8 grouped,
    int4 grouped and int4 per-channel (the int4 kernel's sub-groups); with the native kernel
    (the default where it builds) its layout per channel and grouped."""
    from shardwise.kernels.cpu import native, quant as cpu_quant

    monkeypatch.setenv(native.ENV, kernel)
    if kernel == "native" and not native.load():
        pytest.skip("the native CPU quant kernel does not build here (its log line says why)")

    kinds = set()
    for in_features, out_features, group_size in CPU_QUANT:
        for bits in (8, 4):
            if bits == 4 and group_size == 16:
                continue  # as _quant_cases
            qw = quantize_weight(quant_weight(out_features, in_features), bits, group_size)
            packed = cpu_quant.quant_linear.prepack(qw, "cpu", BF16)
            kinds.add((packed.meta["kind"], qw.spec.n_groups > 1))
    assert kinds == expected


def test_every_builtin_accelerators_backend_is_a_target():
    """The backends the built-in accelerators resolve through are the ones the matrix runs."""
    from shardwise.plugins import accelerator_plugins

    listed = set()
    for record in accelerator_plugins().records.values():
        if record.loaded and record.target.startswith("shardwise.accelerators."):
            listed.update(record.obj.kernel_backends)
    assert listed and listed <= set(BACKEND_OF.values()), listed
