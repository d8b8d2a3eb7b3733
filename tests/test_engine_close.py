"""``engine.close()`` and ``with shardwise.init_inference(...) as engine:`` give the model back, on
every transform combination: kernel injection, CPU graphs, int8 and int4 quantization (alone,
with injection, with injection and graphs), a bf16 cast, and TP=2 (alone, with injection, with
int8/int4 quantization; one two-rank run of every case).

After close the model has the module types, parameter names/shapes/dtypes, hooks (none of the
engine's, the user's kept) and instance forwards (none) it was handed in with; its weights are
the originals — bit for bit after injection, graphs and TP; the originals rounded to bf16 after a
bf16 cast; within the quantization bound (``families.QUANT_BOUNDS``, the one test_quant.py uses)
after int8/int4 — and so are its logits. The graphs and KV buffers are freed (weak references
die, even while the user holds the injected stack), and while the engine runs memory holds one
copy of the weights (the originals the model no longer holds are freed at init, the ledger's
undos rebuild them at close).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import shardwise
from families import QUANT_BOUNDS
from models import logit_parity, prompt_ids, tiny_causal_lm
from shardwise.engine import EngineClosedError, NotRestorableError
from shardwise.inject.injector import injected_stack
from shardwise.ledger import Ledger, RestoreError

pytestmark = pytest.mark.usefixtures("one_thread")

HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
              "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called",
              "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
              "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
              "_load_state_dict_post_hooks")
INJECT = dict(replace_with_kernel_inject=True)
GRAPHS = dict(replace_with_kernel_inject=True, enable_graph=True)


def quant(bits: int) -> dict:
    return dict(quant={"weight": {"num_bits": bits}})


#: case → (family, init_inference keywords); fp32 unless a dtype is given (quantized layers then
#: run their fast kernels in bf16, every other weight stays fp32 and comes back exactly)
CASES = {
    "inject": ("llama", INJECT),
    "inject+graphs": ("llama", GRAPHS),
    "gpt2 inject+graphs": ("gpt2", GRAPHS),  # Conv1D linears, a head tied to the embedding
    "int8": ("llama", quant(8)),
    "int8+inject": ("llama", {**quant(8), **INJECT}),
    "int8+inject+graphs": ("llama", {**quant(8), **GRAPHS}),
    "gpt2 int8": ("gpt2", quant(8)),
    "int4": ("llama", quant(4)),
    "int4+inject": ("llama", {**quant(4), **INJECT}),
    "int4+inject+graphs": ("llama", {**quant(4), **GRAPHS}),
    "bf16+inject": ("llama", dict(dtype=torch.bfloat16, **INJECT)),
}


# ----- what the model was, and what it must be again --------------------------------------------


def hooks(model: nn.Module) -> dict:
    return {n: tuple(len(getattr(m, h, ())) for h in HOOK_DICTS) for n, m in model.named_modules()}


def describe(model: nn.Module, ids: torch.Tensor) -> dict:
    """Everything close() must give back: structure, weights (copies) and logits."""
    with torch.no_grad():
        logits = model(ids).logits
    return {
        "types": [(n, type(m)) for n, m in model.named_modules()],
        "params": [(n, tuple(p.shape), p.dtype, p.device, p.requires_grad)
                   for n, p in model.named_parameters()],
        "buffers": [(n, tuple(b.shape), b.dtype, b.device) for n, b in model.named_buffers()],
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        "hooks": hooks(model),
        "attrs": {n: sorted(vars(m)) for n, m in model.named_modules()},
        "logits": logits,
    }


def storages(model: nn.Module) -> list[StorageWeakRef]:
    """Weak references to the storages of the model's parameters."""
    return [StorageWeakRef(p.untyped_storage()) for p in model.parameters()]


def held_twice(originals: list[StorageWeakRef], model: nn.Module) -> int:
    """How many original parameter storages are still alive although the live model no longer
    holds them (kept by someone: a second copy of those weights)."""
    gc.collect()
    live = {StorageWeakRef(t.untyped_storage()).cdata
            for t in (*model.parameters(), *model.buffers()) if not t.is_meta}
    return sum(1 for ref in originals if not ref.expired() and ref.cdata not in live)


def parameter_storages() -> dict[int, tuple[StorageWeakRef, int]]:
    """Every Parameter alive in this process (found by the garbage collector): storage →
    (a weak reference keeping its address from being reused, bytes)."""
    gc.collect()
    out = {}
    for obj in gc.get_objects():
        if type(obj) is nn.Parameter and not obj.is_meta:  # (not FakeTensors compile keeps)
            ref = StorageWeakRef(obj.untyped_storage())
            out.setdefault(ref.cdata, (ref, obj.untyped_storage().nbytes()))
    return out


def stray_parameter_bytes(baseline: dict, model: nn.Module) -> int:
    """Bytes of Parameters made since ``baseline`` that the live model does not hold: a copy
    of weights some step kept beside the ones the model runs on (e.g. a replaced linear's
    full-precision weight, or an intermediate slice)."""
    live = {StorageWeakRef(t.untyped_storage()).cdata
            for t in (*model.parameters(), *model.buffers()) if not t.is_meta}
    return sum(nbytes for cdata, (_, nbytes) in parameter_storages().items()
               if cdata not in baseline and cdata not in live)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def given_back_problems(model: nn.Module, before: dict, ids: torch.Tensor, *,
                        bits: int | None = None, quantized: set[str] = frozenset(),
                        rounded_to: torch.dtype | None = None) -> list[str]:
    """What differs from ``before`` (empty: the model is as handed in). ``bits``/``quantized``:
    those layers' weights and the logits may differ within ``QUANT_BOUNDS[bits]``;
    ``rounded_to``: every weight must equal its original rounded to that dtype."""
    now = describe(model, ids)
    problems = []
    for key in ("types", "params", "buffers", "hooks", "attrs"):
        if now[key] != before[key]:
            diff = [x for x in now[key] if x not in before[key]] if isinstance(
                now[key], list) else {k: v for k, v in now[key].items() if before[key].get(k) != v}
            problems.append(f"{key} differ: {str(diff)[:300]}")
    if any("forward" in vars(m) for m in model.modules()):
        problems.append("an instance-level forward is left")
    max_rel, min_agree = QUANT_BOUNDS[bits] if bits else (0.0, 1.0)
    for name, original in before["weights"].items():
        got = now["weights"].get(name)
        if got is None or got.shape != original.shape or got.dtype != original.dtype:
            continue  # reported as a params difference
        layer = name.rpartition(".")[0]
        if layer in quantized and name.endswith("weight"):
            if rel(got, original) > max_rel:
                problems.append(f"{name}: relative error {rel(got, original):.4f} > {max_rel}")
        else:
            expected = original if rounded_to is None else original.to(rounded_to).to(
                original.dtype)
            if not torch.equal(got, expected):
                problems.append(f"{name}: not the original values (max |diff| "
                                f"{(got - expected).abs().max().item():.3g})")
    logits, ref = now["logits"], before["logits"]
    if bits:
        r, agree = logit_parity(ref, logits)
        if r > max_rel or agree < min_agree:
            problems.append(f"logits: relative error {r:.4f} (<= {max_rel}), agreement "
                            f"{agree:.2f} (>= {min_agree})")
    elif rounded_to is None and not torch.equal(logits, ref):
        problems.append(f"logits differ (max {(logits - ref).abs().max().item():.3g})")
    return problems


def quantized_layers(engine) -> set[str]:
    return set(engine.quantization.layers) if engine.quantization is not None else set()


def runtime_refs(engine, ids: torch.Tensor) -> tuple[object, list[weakref.ref]]:
    """(the injected stack, weak references to its KV buffers and captured graphs), after one
    forward and one generate (a decode step, replayed from the graph when there is one)."""
    engine.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    out = engine(input_ids=ids)
    cache = out.past_key_values
    refs = [weakref.ref(t) for t in (*cache.buffers.k, *cache.buffers.v)]
    stack = injected_stack(engine.module)
    if stack.graphs is not None:
        refs += [weakref.ref(g) for g in stack.graphs.graphs.values()]
    return stack, refs


# ----- every single-process combination ---------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_close_gives_the_model_back(case):
    arch, options = CASES[case]
    bits = options.get("quant", {}).get("weight", {}).get("num_bits")
    model, ids = tiny_causal_lm(arch), prompt_ids()
    before, originals, baseline = describe(model, ids), storages(model), parameter_storages()
    engine = shardwise.init_inference(model, device="cpu", **options)
    assert held_twice(originals, model) == 0, "init kept a second copy of replaced weights"
    assert stray_parameter_bytes(baseline, model) == 0, "init kept weights the model does not use"
    if bits:
        assert engine.quantization.layers_quantized > 0
    quantized = quantized_layers(engine)
    stack, refs = runtime_refs(engine, ids) if options.get("replace_with_kernel_inject") else (
        None, [])
    assert engine.close() is model
    gc.collect()
    assert not [r for r in refs if r() is not None], "KV buffers or graphs outlived close()"
    if stack is not None and stack.graphs is not None:
        assert not stack.graphs.graphs  # freed even though the test still holds the stack
    problems = given_back_problems(model, before, ids, bits=bits, quantized=quantized,
                                   rounded_to=options.get("dtype"))
    assert not problems, problems
    assert engine.close() is model  # twice: the same
    with pytest.raises(EngineClosedError, match="closed"):
        engine(input_ids=ids)
    with pytest.raises(EngineClosedError):
        engine.generate(ids, max_new_tokens=1)


def test_close_gives_back_an_injected_encoder():
    """BERT under encoder injection (no KV cache, no generate): its modules, weights and
    outputs come back."""
    from models import tiny_encoder

    model = tiny_encoder("bert")
    ids = prompt_ids(batch=2)
    with torch.no_grad():
        expected = model(ids).logits
    types = [(n, type(m)) for n, m in model.named_modules()]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with shardwise.init_inference(model, device="cpu", **INJECT) as engine:
        engine(input_ids=ids)
        assert [(n, type(m)) for n, m in model.named_modules()] != types
    assert [(n, type(m)) for n, m in model.named_modules()] == types
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    assert not any("forward" in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


def test_weights_rebuilt_in_inference_mode_are_normal_tensors():
    """close() called inside torch.inference_mode: the rebuilt (cast back) weights are normal
    tensors, so the model given back can still be trained."""
    model = tiny_causal_lm("llama")
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.bfloat16)
    with torch.inference_mode():
        engine.close()
    assert not any(p.is_inference() for p in model.parameters())
    loss = model(prompt_ids(), labels=prompt_ids()).loss
    loss.backward()
    assert model.lm_head.weight.grad is not None


def test_close_logs_that_quantized_weights_come_back_dequantized(caplog):
    model = tiny_causal_lm("llama")
    engine = shardwise.init_inference(model, device="cpu", **quant(8))
    with caplog.at_level("INFO", logger="shardwise.engine"):
        engine.close()
    assert "dequantized" in caplog.text, caplog.text


# ----- the with-form -----------------------------------------------------------------------------


def test_with_block_closes_the_engine():
    model, ids = tiny_causal_lm("llama"), prompt_ids()
    before = describe(model, ids)
    with shardwise.init_inference(model, device="cpu", **INJECT) as engine:
        assert type(model.model).__name__ == "InjectedModel"
        engine.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert not given_back_problems(model, before, ids)
    with pytest.raises(EngineClosedError):
        engine(input_ids=ids)


def test_an_exception_in_the_block_still_closes_and_propagates():
    model, ids = tiny_causal_lm("llama"), prompt_ids()
    before = describe(model, ids)
    with pytest.raises(KeyError, match="raised in the block"):
        with shardwise.init_inference(model, device="cpu", **INJECT):
            raise KeyError("raised in the block")
    assert not given_back_problems(model, before, ids)


def test_a_failing_close_does_not_mask_the_blocks_exception(monkeypatch):
    model = tiny_causal_lm("llama")

    def failing(self):
        raise RestoreError("close failed (injected by the test)")
    monkeypatch.setattr(Ledger, "give_back", failing)
    with pytest.raises(KeyError, match="raised in the block") as info:
        with shardwise.init_inference(model, device="cpu", **INJECT):
            raise KeyError("raised in the block")
    assert any("close failed (injected by the test)" in n for n in info.value.__notes__)
    # without an exception in the block, the close error is the one raised
    with pytest.raises(RestoreError, match="injected by the test"):
        with shardwise.init_inference(tiny_causal_lm("llama"), device="cpu", **INJECT):
            pass


# ----- a change with no recorded undo -------------------------------------------------------------


@pytest.mark.parametrize("change", ["cast", "copy"])
def test_a_weight_changed_without_an_undo_is_named_by_close(monkeypatch, change):
    """A step that replaces a weight without recording its undo: close() raises
    NotRestorableError naming exactly that weight (never gives it back wrong), and every other
    weight, the modules and the hooks are back. ``copy``: same dtype and shape, new storage —
    still caught (the model holds what init left there)."""
    from shardwise import transforms

    model, ids = tiny_causal_lm("llama"), prompt_ids()
    before = describe(model, ids)
    real = transforms.cast_and_move

    def cast_and_change_one(m, device, dtype, **kwargs):
        real(m, device, dtype, **kwargs)
        w = m.model.layers[1].mlp.up_proj.weight
        w.data = w.data.to(torch.float64) if change == "cast" else w.data.clone() * 1
    monkeypatch.setattr(transforms, "cast_and_move", cast_and_change_one)
    engine = shardwise.init_inference(model, device="cpu", **INJECT)
    monkeypatch.undo()
    with pytest.raises(NotRestorableError) as info:
        engine.close()
    name = "model.layers.1.mlp.up_proj.weight"
    message = str(info.value)
    assert f"1 weight(s) cannot be given back" in message and f"{name} (was float32" in message
    assert [(n, type(m)) for n, m in model.named_modules()] == before["types"]
    assert hooks(model) == before["hooks"] and not any("forward" in vars(m)
                                                       for m in model.modules())
    for n, p in model.named_parameters():
        assert n == name or torch.equal(p, before["weights"][n]), n
    with pytest.raises(NotRestorableError):  # a second close says the same
        engine.close()


def test_ledger_gives_back_weights_rebuilt_by_their_undos():
    """The Ledger alone: a weight re-pointed (with an undo), a module replaced by a new one
    whose undo builds yet another object, and a weight replaced with no undo; drop_replaced
    frees the originals; give_back rebuilds, puts the original objects back and names the
    one weight it cannot."""
    from shardwise import ledger as ledger_mod

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    weights = [m.weight.detach().clone() for m in model]
    objects = [(m, m.weight, m.bias) for m in model]
    refs = [StorageWeakRef(w.untyped_storage()) for _, w, _ in objects]
    ledger = Ledger(model)
    with ledger.recording():
        w0 = model[0].weight  # cast with an undo that re-points the original Parameter
        w0.data = w0.data.to(torch.bfloat16)
        ledger_mod.record("cast back", lambda: setattr(w0, "data", w0.data.float()))
        old = model[1]  # a module replaced; its undo puts a *new* Linear with the values back
        kept = (old.weight.detach().clone(), old.bias.detach().clone())
        model._modules["1"] = nn.Identity()

        def rebuild():
            fresh = nn.Linear(4, 4)
            fresh.weight.data, fresh.bias.data = kept[0].clone(), kept[1].clone()
            model._modules["1"] = fresh
        ledger_mod.record("rebuild linear 1", rebuild)
        model[2].weight.data = model[2].weight.data * 2  # no undo recorded
    assert ledger.drop_replaced() > 0
    gc.collect()
    assert refs[0].expired() and refs[1].expired() and refs[2].expired()  # no second copy
    assert old.weight.numel() == 0  # the replaced module's weight let go of too
    with pytest.raises(NotRestorableError, match=r"1 weight\(s\).* 2\.weight \(was float32") \
            as info:
        ledger.give_back()
    assert "0.weight" not in str(info.value) and "1.weight" not in str(info.value)
    assert all(m is o and m.weight is w and m.bias is b
               for m, (o, w, b) in zip(model, objects))  # the original objects
    assert torch.equal(model[0].weight, weights[0].bfloat16().float())
    assert model[0].weight.dtype == torch.float32 and torch.equal(model[1].weight, weights[1])
    assert torch.equal(model[1].bias, kept[1])


def test_memory_holds_one_copy_after_a_cast():
    """bf16 cast + injection: the fp32 originals are freed at init (the cast's undo casts
    back at close), and close gives back fp32 weights equal to the bf16-rounded originals."""
    model, ids = tiny_causal_lm("llama"), prompt_ids()
    originals = storages(model)
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.bfloat16, **INJECT)
    gc.collect()
    assert sum(ref.expired() for ref in originals) == len(originals)
    engine.close()
    assert all(p.dtype == torch.float32 for p in model.parameters())


# ----- TP=2: one two-rank run of every case -------------------------------------------------------

TP = dict(device="cpu", tensor_parallel={"tp_size": 2})
TP_CASES = {
    "tp": {},
    "tp+inject": INJECT,
    "tp+int8": quant(8),
    "tp+int8+inject": {**quant(8), **INJECT},
    "tp+int4+inject": {**quant(4), **INJECT},
}


def _tp_case(options: dict) -> dict:
    bits = options.get("quant", {}).get("weight", {}).get("num_bits")
    model, ids = tiny_causal_lm("llama"), prompt_ids()
    before, originals, baseline = describe(model, ids), storages(model), parameter_storages()
    engine = shardwise.init_inference(model, **TP, **options)
    twice = held_twice(originals, model) + stray_parameter_bytes(baseline, model)
    sharded = engine.sharding is not None and engine.communicator.world_size == 2
    engine(input_ids=ids)
    quantized = quantized_layers(engine)
    shm = engine.communicator.shm_enabled  # the CPU communicator's shared-memory segment
    given = engine.close()
    return {"given_back": given is model, "held_twice": twice, "sharded": sharded,
            "shm": [shm, engine.communicator.shm_enabled],
            "problems": given_back_problems(model, before, ids, bits=bits, quantized=quantized)}


def _tp_checkpoint_case(directory: str, options: dict) -> dict:
    """Each rank reads its slices of a checkpoint into the user's meta model (quantizing while
    reading): close gives the meta model back, structure and all."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    types, names = [(n, type(m)) for n, m in model.named_modules()], hooks(model)
    engine = shardwise.init_inference(model, checkpoint=directory, **TP, **options)
    engine(input_ids=prompt_ids())
    given = engine.close()
    problems = [what for what, bad in [
        ("types", [(n, type(m)) for n, m in model.named_modules()] != types),
        ("hooks", hooks(model) != names),
        ("forwards", any("forward" in vars(m) for m in model.modules())),
        ("not on meta", not all(p.is_meta for p in model.parameters()))] if bad]
    return {"given_back": given is model, "held_twice": 0, "shm": [True, False],
            "sharded": engine.sharding is not None, "problems": problems}


def _tp_cases(rank: int, directory: str) -> dict:
    import traceback

    torch.set_num_threads(1)
    cases = {name: (lambda o=options: _tp_case(o)) for name, options in TP_CASES.items()}
    cases["tp+checkpoint+int8+inject (meta model)"] = lambda: _tp_checkpoint_case(
        directory, {**quant(8), **INJECT})
    out = {}
    for name, run in cases.items():
        try:
            out[name] = {"ok": True, **run()}
        except Exception as exc:
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                         "trace": traceback.format_exc()}
    return out


def test_tp2_close_gathers_the_shards_back(tmp_path):
    from distributed import run_ranks

    directory = tmp_path / "checkpoint"
    tiny_causal_lm("llama").save_pretrained(directory)
    results = run_ranks(_tp_cases, 2, tmp_path, str(directory), deadline_s=400)
    failures = []
    for rank, result in enumerate(results):
        assert result["ok"], result.get("trace", result.get("error"))
        for name, case in result["value"].items():
            if not case["ok"]:
                failures.append(f"rank {rank} {name}: {case['trace']}")
                continue
            if not case["sharded"]:
                failures.append(f"rank {rank} {name}: nothing was sharded")
            if case["held_twice"]:
                failures.append(f"rank {rank} {name}: {case['held_twice']} original weights "
                                f"or bytes of stray copies kept beside the shards")
            if case["shm"][1]:
                failures.append(f"rank {rank} {name}: the shared-memory segment outlived close")
            if not case["given_back"] or case["problems"]:
                failures.append(f"rank {rank} {name}: {case['problems']}")
    assert not failures, "\n".join(failures)
    from shardwise.accelerators.cpu_shm_protocol import local_refusal

    if not local_refusal():  # where the shared-memory all-reduce can run, it ran and was freed
        assert all(case["shm"][0] for result in results for case in result["value"].values())
