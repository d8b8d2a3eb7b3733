"""Attention sinks (GPT-OSS: a learned logit per query head in every softmax's denominator).

* the reference kernels against HF's own GPT-OSS attention math (``eager_attention_forward`` of
  transformers.models.gpt_oss), with causal, sliding-window and padding masks and GQA;
* the cpu and triton (interpreted here, tiny shapes) kernels against the reference, prefill and
  decode, with sinks that dominate, that vanish and in between; decode caches hold NaN outside
  each sequence's range;
* bad input (shape, dtype, with ALiBi) is the same KernelError everywhere;
* the injected layer: the sink slice a rank keeps, the graph-safe step's masked fallback;
* the GPT-OSS model (its parity with and without injection, bf16, graphs, its MoE block and its
  ep/tp cases are checked by tests/test_inject.py, tests/test_moe.py and tests/test_moe_ep.py
  through the ``gpt_oss`` family): its sliding and full layers once injected, the policy's
  tensor-parallel plan (not HF's, which splits only the LM head), and on 2 gloo ranks HF's own
  attention at tp=2 (the sinks narrowed to the rank's heads), alone and with ep=2, and injected
  (fp32 logits within ``RANKS_ATOL`` of HF, 32 greedy tokens identical; measured <= 2e-7,
  under load, x86-64, torch 2.13), with close() giving back HF's model bit for bit; a TP=2
  checkpoint (each rank its heads' sinks) read back at tp 2 and 1.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from kernel_inputs import (DECODE_LENGTHS, DECODE_STARTS, TOL, dtype_id, garbage_cache, heads,
                           padding_mask, qkv, window_starts)

import shardwise
from shardwise import KernelError
from shardwise.kernels.cpu import attention as cpu
from shardwise.kernels.reference import attention as ref
from tp_harness import with_random_biases, case, digest, run_pair, run_table

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
#: sink logits per head (4 heads): one dominating, one vanishing, two in the scores' range
SINKS = torch.tensor([6.0, -30.0, 0.5, -1.0])
#: name -> (batch, q_heads, kv_heads, q_len, kv_len, kwargs(device))
PREFILL = {
    "causal-gqa": (2, 4, 2, 13, 13, lambda dev: {}),
    "encoder-mqa": (2, 4, 1, 13, 13, lambda dev: {"causal": False}),
    "chunk": (2, 4, 2, 5, 13, lambda dev: {}),
    "padding": (3, 4, 2, 13, 13, lambda dev: {"key_padding_mask": padding_mask(3, 13, dev)}),
    "window-gqa": (2, 4, 2, 13, 13, lambda dev: {"window": 4}),
    "window-padding": (3, 4, 2, 13, 13, lambda dev: {
        "window": 5, "key_padding_mask": padding_mask(3, 13, dev)}),
    "window-chunk-mha": (2, 4, 4, 5, 13, lambda dev: {"window": 6}),
}
#: (kv_heads, starts, window)
DECODE = [(2, False, None), (1, True, None), (4, True, 8), (2, False, 20)]


def _hf_oracle(q, k, v, sinks, mask, scale):
    """HF GPT-OSS's eager attention: q [b, hq, L, d], k/v [b, hkv, n, d], mask bool
    [b, 1, L, n] → [b, hq, L, d]."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks,
                             training=False)
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    out, _ = eager_attention_forward(module, q, k, v, additive, scaling=scale)
    return out.transpose(1, 2)  # HF returns [b, L, hq, d]


@pytest.mark.parametrize("name", ["causal-gqa", "padding", "window-gqa", "window-padding",
                                  "chunk"])
def test_reference_matches_hf_gpt_oss_attention(name):
    batch, hq, hkv, q_len, kv_len, kwargs = PREFILL[name]
    q, k, v = qkv(batch, hq, hkv, q_len, kv_len, 16)
    kw = kwargs("cpu")
    visible = ref.visible_keys(batch, q_len, kv_len, True, kw.get("key_padding_mask"), "cpu",
                               kw.get("window"))
    alive = visible.any(-1)[:, 0]  # [b, q_len]: HF leaves rows that see nothing undefined
    want = _hf_oracle(q, k, v, SINKS, visible, 0.25)
    got = ref.attention_prefill(q, k, v, scale=0.25, sinks=SINKS, **kw)
    torch.testing.assert_close(got.transpose(1, 2)[alive], want.transpose(1, 2)[alive],
                               atol=1e-6, rtol=1e-6)
    plain = ref.attention_prefill(q, k, v, scale=0.25, **kw)
    assert (plain - got).abs().max() > 0.1  # the sinks change the output


def test_reference_sink_properties():
    """A vanishing sink is plain attention; a dominating one scales the output towards 0; a row
    that sees no key and a sequence with no token give zeros."""
    q, k, v = qkv(3, 4, 2, 13, 13, 16)
    mask = padding_mask(3, 13)
    tiny = torch.full((4,), -1e4)
    torch.testing.assert_close(ref.attention_prefill(q, k, v, sinks=tiny),
                               ref.attention_prefill(q, k, v))
    huge = ref.attention_prefill(q, k, v, sinks=torch.full((4,), 60.0))
    assert huge.abs().max() < 1e-15
    out = ref.attention_prefill(q, k, v, key_padding_mask=mask, causal=False, sinks=SINKS)
    assert torch.isfinite(out).all()
    k_cache, v_cache = garbage_cache(2, 2, 8, 16, [0, 5], F32)
    out = ref.attention_decode(heads(2, 4, 1, 16), k_cache, v_cache, torch.tensor([0, 5]),
                               sinks=SINKS)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isfinite(out).all()


# ----- backends against the reference --------------------------------------------------------


def _triton():
    from shardwise.kernels.triton import attention as triton_attention

    return triton_attention


def _backend(target, request):
    if target == "cpu":
        return cpu, "cpu"
    return _triton(), request.getfixturevalue("triton_device")


TARGETS = [("cpu", F32), ("cpu", BF16), ("cpu", F16), ("triton", F32), ("triton", BF16)]


@pytest.mark.parametrize("target,dtype", TARGETS, ids=[f"{t}-{dtype_id(d)}" for t, d in TARGETS])
@pytest.mark.parametrize("name", list(PREFILL))
def test_prefill_with_sinks_matches_reference(target, dtype, name, request):
    kernels, device = _backend(target, request)
    batch, hq, hkv, q_len, kv_len, kwargs = PREFILL[name]
    q, k, v = qkv(batch, hq, hkv, q_len, kv_len, 24, dtype, device)
    kw = dict(kwargs(device), sinks=SINKS.to(device))
    got = kernels.attention_prefill(q, k, v, **kw)
    want = ref.attention_prefill(q, k, v, **kw)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("target,dtype", TARGETS, ids=[f"{t}-{dtype_id(d)}" for t, d in TARGETS])
@pytest.mark.parametrize("kv_heads,starts,window", DECODE)
@pytest.mark.parametrize("same", [False, True], ids=["ragged", "same-ranges"])
def test_decode_with_sinks_matches_reference(target, dtype, kv_heads, starts, window, same,
                                             request):
    """Ragged lengths (one 0, one full) with left padding and windows; the cache holds NaN
    outside each range, so a backend that reads there fails. ``same``: every sequence the same
    range (the cpu backend's one-call path)."""
    kernels, device = _backend(target, request)
    lengths, firsts = DECODE_LENGTHS, (DECODE_STARTS if starts else None)
    if same:
        lengths, firsts = [17] * 4, ([2] * 4 if starts else None)
    q = heads(4, 4, 1, 24, dtype, device)
    k_cache, v_cache = garbage_cache(4, kv_heads, 40, 24, lengths, dtype, device,
                                     window_starts(lengths, firsts, window))
    kw = {"window": window, "sinks": SINKS.to(device)}
    if firsts:
        kw["starts"] = torch.tensor(firsts, device=device)
    n = torch.tensor(lengths, device=device,
                     dtype=torch.int32 if target == "triton" else torch.int64)
    extra = {"num_splits": 3, "block_n": 16} if target == "triton" else {}
    got = kernels.attention_decode(q, k_cache, v_cache, n, **kw, **extra)
    want = ref.attention_decode(q, k_cache, v_cache, n, **kw)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_cpu_decode_op_with_sinks_is_a_checked_custom_op():
    """What the compiled decode step calls (``shardwise::cpu_attention_decode``): same numbers,
    and its schema/fake registration pass torch's own checks with sinks."""
    q = heads(2, 4, 1, 16)
    k_cache, v_cache = garbage_cache(2, 2, 12, 16, [12, 7], F32)
    args = (q, k_cache, v_cache, torch.tensor([12, 7]), None, None, None, 8, SINKS)
    got = torch.ops.shardwise.cpu_attention_decode(*args)
    want = ref.attention_decode(q, k_cache, v_cache, torch.tensor([12, 7]), window=8,
                                sinks=SINKS)
    torch.testing.assert_close(got, want, **TOL[F32])
    torch.library.opcheck(torch.ops.shardwise.cpu_attention_decode.default, args,
                          test_utils=("test_schema", "test_faketensor"))


BAD_SINKS = {
    "shape": lambda dev: {"sinks": torch.zeros(3, device=dev)},
    "integer": lambda dev: {"sinks": torch.zeros(4, dtype=torch.int64, device=dev)},
    "with-alibi": lambda dev: {"sinks": torch.zeros(4, device=dev),
                               "alibi_slopes": ref.alibi_slopes(4, dev)},
}


@pytest.mark.parametrize("target", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("bad", list(BAD_SINKS))
def test_bad_sinks_are_refused_everywhere(target, bad, request):
    kernels = {"reference": ref, "cpu": cpu}.get(target) or _triton()
    device = request.getfixturevalue("triton_device") if target == "triton" else "cpu"
    q, k, v = qkv(1, 4, 2, 3, 3, 16, F32, device)
    kw = BAD_SINKS[bad](device)
    with pytest.raises(KernelError, match="sinks"):
        kernels.attention_prefill(q, k, v, **kw)
    k_cache, v_cache = garbage_cache(1, 2, 4, 16, [3], F32, device)
    with pytest.raises(KernelError, match="sinks"):
        kernels.attention_decode(q[:, :, :1], k_cache, v_cache,
                                 torch.tensor([3], device=device), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=dtype_id)
def test_triton_sinks_at_gpt_oss_sizes(dtype):
    """GPT-OSS-20B's attention shapes (64 query heads over 8 kv heads of 64, window 128) on the
    GPU: prefill of 333 tokens and decode over 4096-token caches, against the reference."""
    tri = _triton()
    sinks = torch.randn(64, generator=torch.Generator().manual_seed(0)).cuda()
    q, k, v = qkv(2, 64, 8, 333, 333, 64, dtype, "cuda")
    for window in (None, 128):
        kw = {"window": window, "sinks": sinks}
        torch.testing.assert_close(tri.attention_prefill(q, k, v, **kw),
                                   ref.attention_prefill(q, k, v, **kw), **TOL[dtype])
    lengths = [4096, 1500, 7, 3000]
    q = heads(4, 64, 1, 64, dtype, "cuda")
    for window in (None, 128):
        k_cache, v_cache = garbage_cache(4, 8, 4096, 64, lengths, dtype, "cuda",
                                         window_starts(lengths, None, window))
        n = torch.tensor(lengths, device="cuda", dtype=torch.int32)
        kw = {"window": window, "sinks": sinks}
        torch.testing.assert_close(tri.attention_decode(q, k_cache, v_cache, n, **kw),
                                   ref.attention_decode(q, k_cache, v_cache, n, **kw),
                                   **TOL[dtype])


# ----- the injected layer ----------------------------------------------------------------------


def _attention_spec(**kw):
    from shardwise.inject.spec import Attention

    return Attention(qkv=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     out_proj="self_attn.o_proj", **kw)


def _layer_with_sinks(n):
    layer = torch.nn.Module()
    layer.self_attn = torch.nn.Module()
    layer.self_attn.sinks = torch.nn.Parameter(torch.arange(float(n)))
    return layer


def test_injector_keeps_this_ranks_sinks():
    """Every head's sinks are sliced to the rank's heads (a float32 copy); sinks already holding
    only the rank's heads are kept; anything else is a named InjectionError."""
    from shardwise.inject.injector import InjectionError, _sinks
    from shardwise.layout import HeadCounts, HeadPartition

    counts, spec = HeadCounts(4, 2, 16), _attention_spec(sinks="self_attn.sinks")
    rank1 = HeadPartition.compute(4, 2, 16, tp_size=2, rank=1)
    model = torch.nn.Module()
    assert torch.equal(_sinks(model, spec, _layer_with_sinks(4), 0, counts, None),
                       torch.arange(4.0))
    assert torch.equal(_sinks(model, spec, _layer_with_sinks(4), 0, counts, rank1),
                       torch.tensor([2.0, 3.0]))
    assert torch.equal(_sinks(model, spec, _layer_with_sinks(2), 0, counts, rank1),
                       torch.tensor([0.0, 1.0]))
    assert _sinks(model, _attention_spec(), _layer_with_sinks(4), 0, counts, None) is None
    with pytest.raises(InjectionError, match="3 sink logits"):
        _sinks(model, spec, _layer_with_sinks(3), 0, counts, rank1)
    with pytest.raises(InjectionError, match="no attention-sink parameter"):
        _sinks(model, _attention_spec(sinks="self_attn.missing"), _layer_with_sinks(4), 0,
               counts, None)
    with pytest.raises(ValueError, match="sinks"):
        _attention_spec(sinks="")


@pytest.mark.parametrize("window", [None, 6])
def test_masked_sink_attention_matches_the_reference(window):
    """The graph-safe step's fallback without a capturable decode kernel (attention over the
    whole static cache, masked) gives the reference kernel's decode, sinks included."""
    from shardwise.inject.layers import masked_sink_attention

    lengths, firsts = [23, 1, 9, 40], [5, 0, 0, 17]
    q = heads(4, 4, 1, 24)
    k_cache, v_cache = garbage_cache(4, 2, 40, 24, lengths, F32, starts=firsts)  # NaN keys out
    n, s = torch.tensor(lengths), torch.tensor(firsts)
    first = s if window is None else torch.maximum(s, n - window)
    slots = torch.arange(40)[None]
    visible = ((slots >= first[:, None]) & (slots < n[:, None]))[:, None, None, :]
    got = masked_sink_attention(q, k_cache, v_cache, visible, 0.2, SINKS)
    want = ref.attention_decode(q, k_cache, v_cache, n, starts=s, window=window, scale=0.2,
                                sinks=SINKS)
    torch.testing.assert_close(got, want, **TOL[F32])


# ----- the GPT-OSS model -------------------------------------------------------------------------

RANKS_ATOL = 1e-5
NEW = 32


def test_gpt_oss_injected_layers_alternate_windows_and_keep_the_sinks():
    from models import tiny_causal_lm

    from shardwise.inject.injector import injected_stack

    model = tiny_causal_lm("gpt_oss")
    sinks = [layer.self_attn.sinks.detach().clone() for layer in model.model.layers]
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                      replace_with_kernel_inject=True)
    layers = injected_stack(engine.module).parts.layers
    assert [layer.setup.window for layer in layers] == [4, None]  # sliding, then full
    for layer, want in zip(layers, sinks):
        assert torch.equal(layer.attn_kw["sinks"], want)
    engine.close()


def test_gpt_oss_tensor_parallel_plan_is_the_policys():
    """HF's GPT-OSS plan splits only vocab tables (transformers 4.x: the causal-LM class's
    LM-head entry; 5.x: the embedding too), none of the blocks: used alone it would leave the
    attention whole on every rank."""
    from models import tiny_causal_lm

    from shardwise.policy import policy_for
    from shardwise.sharding.plan import choose_plan

    model = tiny_causal_lm("gpt_oss")
    plan = choose_plan(model, policy=policy_for(model))
    assert plan.source == "policy:gpt_oss"
    assert any("only its vocab tables" in note for note in plan.notes)


#: name -> (settings, inject). HF's own attention on the rank's heads (the sinks narrowed by the
#: sharding), and injected; tests/test_moe_ep.py runs the ``gpt_oss`` family's other ep/tp cases
RANK_CASES = {
    "tp2": ({"tensor_parallel": {"tp_size": 2}}, False),
    "tp2-ep2": ({"tensor_parallel": {"tp_size": 2}, "moe": {"ep_size": 2}}, False),
    "tp2-ep2-injected": ({"tensor_parallel": {"tp_size": 2}, "moe": {"ep_size": 2}}, True),
}


def _rank_case(rank: int, settings: dict, inject: bool, save_to: str | None = None) -> dict:
    from models import prompt_ids, tiny_causal_lm

    ref_model = with_random_biases(tiny_causal_lm("gpt_oss"))
    model = with_random_biases(tiny_causal_lm("gpt_oss"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = prompt_ids(batch=2, length=8)
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want, want_tokens = ref_model(ids).logits, ref_model.generate(ids, **gen)
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                      replace_with_kernel_inject=inject, **settings)
    sinks_held = model.model.layers[0].self_attn.sinks.numel()
    logits = engine(input_ids=ids).logits
    tokens = engine.generate(ids, **gen)
    reload_max_abs = None
    if save_to:  # each rank writes its heads' sinks; read back at the same tp size
        engine.save_checkpoint(save_to)
        again = shardwise.init_inference(None, checkpoint=save_to, device="cpu",
                                         dtype=torch.float32, **settings)
        reload_max_abs = (again(input_ids=ids).logits - want).abs().max().item()
        again.close()
    engine.close()
    after = model.state_dict()
    return dict(max_abs=(logits - want).abs().max().item(), reload_max_abs=reload_max_abs,
                tokens_equal=torch.equal(tokens, want_tokens), digest=digest(logits),
                sinks_held=sinks_held,
                restored=after.keys() == before.keys() and all(
                    torch.equal(after[k], v) for k, v in before.items()))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every case of RANK_CASES in ONE pair of ranks; "tp2" also saves a checkpoint: (each rank's
    results, the checkpoint's directory)."""
    saved = tmp_path_factory.mktemp("gpt_oss_tp2_checkpoint")
    table = {name: (*args, str(saved) if name == "tp2" else None)
             for name, args in RANK_CASES.items()}
    results = run_pair(partial(run_table, fn=_rank_case, table=table),
                       tmp_path_factory.mktemp("gpt_oss_ranks"), deadline_s=420)
    return results, saved


@pytest.mark.parametrize("name", list(RANK_CASES))
def test_gpt_oss_on_two_ranks_matches_hf(ranks, name):
    r0, r1 = case(ranks[0], name)
    settings, _ = RANK_CASES[name]
    print(f"gpt_oss {name}: max |logit diff| {max(r0['max_abs'], r1['max_abs']):.2e}")
    for r in (r0, r1):
        assert r["max_abs"] < RANKS_ATOL, r["max_abs"]
        assert r["tokens_equal"]
        assert r["restored"]  # sinks whole, experts gathered and back in GPT-OSS's layout
        assert r["sinks_held"] == (2 if "tensor_parallel" in settings else 4)
    assert r0["digest"] == r1["digest"]


def test_gpt_oss_tp2_checkpoint_reads_back_at_tp2_and_tp1(ranks):
    """The sinks are split by heads in a TP=2 checkpoint like the q projection (saved as the
    rank's half of a whole tensor they would not load: a shape error at tp 1)."""
    from models import prompt_ids, tiny_causal_lm

    results, saved = ranks
    r0, r1 = case(results, "tp2")
    assert r0["reload_max_abs"] < RANKS_ATOL and r1["reload_max_abs"] < RANKS_ATOL
    ref_model = with_random_biases(tiny_causal_lm("gpt_oss"))
    ids = prompt_ids(batch=2, length=8)
    with torch.no_grad():
        want = ref_model(ids).logits
    engine = shardwise.init_inference(None, checkpoint=str(saved), device="cpu",
                                      dtype=torch.float32)
    assert engine.module.model.layers[0].self_attn.sinks.shape == (4,)
    assert (engine(input_ids=ids).logits - want).abs().max().item() < RANKS_ATOL
    engine.close()
