"""CPU decode-step graphs: :class:`CpuCompileStrategy` (``torch.compile``, inductor freezing,
prepacked linear weights) against the eager decode step and plain HF.

Parity (tiny random models, tests/models.py, fp32): every decode step's logits within
``FP32_ATOL`` = 1e-5 of the injected model run eagerly (enable_graph=False), 32 greedy tokens
identical to HF's. The compiled step sums in another order (packed GEMV kernels, vectorized
reductions), never in another dtype. Each capture compiles C++ (seconds on tiny models), so the
tests share engines and count compilations.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.nn.functional as F

import shardwise
from shardwise.accelerator import GraphStrategy
from shardwise.accelerators import cpu as cpu_mod
from shardwise.accelerators import cpu_blocked_layout as layout
from shardwise.accelerators import cpu_graphs
from shardwise.accelerators import cpu_precompile as precompile
from shardwise.accelerators.cpu import CpuAccelerator
from shardwise.accelerators.cpu_graphs import CpuCompileStrategy, PackLinearWeights
from shardwise.errors import ConfigError
from shardwise.graphs import StaticGraph
from families import families
from models import prompt_ids, tiny_causal_lm

FP32_ATOL = 1e-5
NEW = 32
GREEDY = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)


def _engine(arch: str, **kwargs):
    return shardwise.init_inference(tiny_causal_lm(arch), device="cpu",
                                    replace_with_kernel_inject=True, **kwargs)


def _generate(engine, ids, **kwargs):
    out = engine.generate(ids, output_logits=True, return_dict_in_generate=True,
                          **{**GREEDY, **kwargs})
    return out.sequences, torch.stack(out.logits).float()


def _strategy(engine) -> CpuCompileStrategy:
    strategy = engine.module.base_model.graphs.strategy
    assert isinstance(strategy, CpuCompileStrategy)
    return strategy


#: the user's store folder (the fixture below patches the module attribute)
_USER_FOLDER = precompile.precompiled_folder


@pytest.fixture(scope="module", autouse=True)
def precompiled_here(tmp_path_factory):
    """This module's precompiled steps in a folder of its own (new each run), so its counts of
    compilations do not depend on what earlier runs left in the user's cache."""
    folder = tmp_path_factory.mktemp("cpu-steps")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(precompile, "precompiled_folder", lambda: folder)
        yield folder


@pytest.fixture(scope="module")
def models():
    """arch -> (HF reference, eager injected engine, compiled injected engine)."""
    made = {}

    def get(arch: str):
        if arch not in made:
            ref = tiny_causal_lm(arch)
            made[arch] = (ref, _engine(arch), _engine(arch, enable_graph=True))
        return made[arch]
    yield get
    made.clear()


# ----- the decode step of tiny models -------------------------------------------------------------

@pytest.mark.parametrize("arch", families(core=True))
def test_compiled_decode_matches_eager_and_hf(models, arch):
    ref, eager, compiled = models(arch)
    strategy = _strategy(compiled)
    assert strategy.compiles == 1  # the init trial (batch 1)
    ids = prompt_ids(batch=1, length=8)
    with torch.no_grad():
        ref_tokens = ref.generate(ids, **GREEDY)
    eager_tokens, eager_logits = _generate(eager, ids)
    tokens, logits = _generate(compiled, ids)
    assert torch.equal(tokens, ref_tokens) and torch.equal(eager_tokens, ref_tokens)
    assert (logits - eager_logits).abs().max().item() < FP32_ATOL
    assert strategy.compiles == 1  # generate reused the init graph: no recompile
    assert torch._inductor.config.freezing is False  # the options stayed scoped


def _poisoned_step(engine, ids: torch.Tensor) -> torch.Tensor:
    """Logits of one decode step after ``ids``, with every cache slot past the filled part
    set to NaN first (a step that reads them, even masked, returns NaN)."""
    with torch.no_grad():
        cache = engine.module(ids, use_cache=True).past_key_values
        for buf in (*cache.buffers.k, *cache.buffers.v):
            buf[:, :, cache.length:] = float("nan")
        nxt = ids[:, -1:]
        return engine.module(nxt, past_key_values=cache, use_cache=True).logits


def test_compiled_step_reads_only_the_filled_cache(models):
    """The compiled step runs the capturable decode kernel (an opaque op reading lengths at
    run time), not a masked attention over all max_tokens slots."""
    ref, eager, compiled = models("llama")
    ids = prompt_ids(batch=1, length=8)
    logits = _poisoned_step(compiled, ids)
    assert torch.isfinite(logits).all()
    assert (logits - _poisoned_step(eager, ids)).abs().max().item() < FP32_ATOL


@pytest.mark.parametrize("arch,batch", [("gpt2", 2), ("llama", 2), ("llama", 3)])
def test_compiled_decode_batch_and_left_padding(models, arch, batch):
    """Batches 2 and 3 (run in the graph of bucket 4, padded), with left padding."""
    ref, eager, compiled = models(arch)
    strategy = _strategy(compiled)
    ids = prompt_ids(batch=batch, length=8)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        ref_tokens = ref.generate(ids, attention_mask=mask, **GREEDY)
    before = strategy.compiles
    tokens, logits = _generate(compiled, ids, attention_mask=mask)
    _, eager_logits = _generate(eager, ids, attention_mask=mask)
    assert torch.equal(tokens, ref_tokens)
    assert (logits - eager_logits).abs().max().item() < FP32_ATOL
    assert strategy.compiles == before + 1  # one graph for the batch's bucket (2 or 4)


def test_untraceable_kernel_fails_at_init_naming_it(monkeypatch):
    from shardwise.kernels.cpu import rotary as cpu_rotary

    real = cpu_rotary._rotate

    def breaks_the_graph(*args):  # what an op dynamo cannot trace does to the step
        torch._dynamo.graph_break()
        return real(*args)

    monkeypatch.setattr(cpu_rotary, "_rotate", breaks_the_graph)
    with pytest.raises(ConfigError, match=r"cannot capture the decode step.*"
                                          r"enable_graph=False"):
        _engine("llama", enable_graph=True)


def test_onednn_packing_rewrites_every_linear(monkeypatch):
    monkeypatch.setenv(cpu_graphs.CPU_GRAPHS_ENV, "onednn")
    ref = tiny_causal_lm("gpt2")
    engine = _engine("gpt2", enable_graph=True)
    strategy = _strategy(engine)
    assert strategy.linear == "onednn" and isinstance(strategy.pack_pass, PackLinearWeights)
    assert strategy.pack_pass.packed == 9  # 2 layers x (qkv, out, fc, proj) + lm_head
    ids = prompt_ids(batch=1, length=8)
    with torch.no_grad():
        ref_tokens = ref.generate(ids, **GREEDY)
    tokens, logits = _generate(engine, ids)
    _, eager_logits = _generate(_engine("gpt2"), ids)
    assert torch.equal(tokens, ref_tokens)
    assert (logits - eager_logits).abs().max().item() < FP32_ATOL


# ----- the strategy on a small function -----------------------------------------------------------

class _Step(torch.nn.Module):
    """A linear, a fused norm and an in-place write into a buffer at a tensor index: the shape of
    a decode step (weights frozen, KV cache mutated in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 32)
        self.cache = torch.zeros(4, 32)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(self.proj(x), (32,))
        self.cache.index_copy_(0, index, h)
        return h.sum(0, keepdim=True) + self.cache.mean(0)


def test_capture_replays_with_new_inputs_mutates_in_place_and_frees():
    torch.manual_seed(0)
    compiled_step, eager_step = _Step().eval(), _Step().eval()
    eager_step.load_state_dict(compiled_step.state_dict())
    strategy = CpuCompileStrategy()
    gc.collect()
    alive_before = _compiled_graphs_alive()
    graph = strategy.capture(compiled_step, torch.randn(1, 16), torch.tensor([0]))
    assert _compiled_graphs_alive() == alive_before + 1
    assert isinstance(graph, StaticGraph) and strategy.compiles == 1
    first = None
    for i in range(4):
        x, index = torch.randn(1, 16), torch.tensor([i])
        got = graph(x, index)
        with torch.no_grad():
            want = eager_step(x, index)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        first = got if first is None else first
        assert got is first  # static outputs, overwritten by each replay
    torch.testing.assert_close(compiled_step.cache, eager_step.cache, rtol=1e-5, atol=1e-5)
    assert strategy.compiles == 1
    with pytest.raises(ValueError, match=r"expected shape \(1, 16\)"):
        graph(torch.randn(2, 16), torch.tensor([0]))
    del graph, got, first
    gc.collect()
    assert _compiled_graphs_alive() == alive_before  # its compiled code and constants are freed


@pytest.mark.parametrize("precompile", ["1", "0"])
@pytest.mark.parametrize("every", [False, True])
def test_replays_check_guards_on_the_first_replay_only(monkeypatch, tmp_path, precompile, every):
    """Dynamo's guards (~1.5 ms a step on a 30-layer model) are evaluated by the capture and
    the first replay, skipped after (a precompiled step's own switch, or dynamo's skip stance
    for a torch.compile'd one), unless SHARDWISE_CPU_GRAPH_GUARDS=every; the replays stay
    right, the in-place cache write included, grad mode on or off."""
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SHARDWISE_CPU_PRECOMPILE", precompile)
    if every:
        monkeypatch.setenv(cpu_graphs.GUARDS_ENV, "every")
    torch.manual_seed(0)
    compiled_step, eager_step = _Step().eval(), _Step().eval()
    eager_step.load_state_dict(compiled_step.state_dict())
    strategy = CpuCompileStrategy()
    graph = strategy.capture(compiled_step, torch.randn(1, 16), torch.tensor([0]))
    assert not graph.guards.skipped  # the capture's own run checked them
    for i in range(4):
        x, index = torch.randn(1, 16), torch.tensor([i])
        with torch.set_grad_enabled(i % 2 == 0):
            got = graph(x, index).clone()
        with torch.no_grad():
            want = eager_step(x, index)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert graph.guards.skipped is (not every)  # from the first replay on
    torch.testing.assert_close(compiled_step.cache, eager_step.cache, rtol=1e-5, atol=1e-5)
    assert strategy.compiles + strategy.loaded == 1  # compiled (or loaded) once, no recompile


def test_guards_setting_is_checked(monkeypatch):
    monkeypatch.setenv(cpu_graphs.GUARDS_ENV, "sometimes")
    with pytest.raises(ConfigError, match="SHARDWISE_CPU_GRAPH_GUARDS='sometimes'.*first"):
        CpuCompileStrategy()


def _compiled_graphs_alive() -> int:
    return sum(type(o).__name__ == "CompiledFxGraph" for o in gc.get_objects())


def test_untraceable_function_fails_at_capture_with_the_way_out():
    def data_dependent(x):
        return x * 2 if x.sum().item() > 0 else x  # a host sync dynamo cannot keep in a graph

    with pytest.raises(RuntimeError, match=r"torch.compile of 'data_dependent' on CPU failed.*"
                                           r"graph break.*"
                                           r"SHARDWISE_CPU_GRAPHS=eager.*enable_graph=False"):
        CpuCompileStrategy().capture(data_dependent, torch.ones(3))


class _BrokenCompiler(CpuCompileStrategy):
    def inductor_options(self) -> dict:
        return {**super().inductor_options(), "cpp.cxx": ("/nonexistent/g++",)}


def test_compile_failure_is_an_init_error(monkeypatch):
    monkeypatch.setattr(CpuAccelerator, "graph_strategy", lambda self: _BrokenCompiler())
    # the compiler hint itself ("not a C++ compiler problem" would also match "C++ compiler")
    with pytest.raises(ConfigError, match=r"cannot capture the decode step.*torch.compile.*"
                                          r"needs a working C\+\+ compiler \(g\+\+ on"):
        _engine("gpt2", enable_graph=True)


def test_an_inductor_failure_names_its_cause_and_does_not_blame_the_compiler(monkeypatch):
    """A failure inside inductor that is not a C++ build (here: its lowering raising) reaches
    the user as that error, under torch's BackendCompilerFailed wrapper, with no advice to
    install a compiler that is there."""
    def failing(gm, example_inputs, options):
        raise NotImplementedError("no lowering for op frobnicate")

    monkeypatch.setattr(cpu_graphs.private, "compile_fx", failing)
    with pytest.raises(RuntimeError) as info:
        CpuCompileStrategy().capture(lambda x: x * 2 + 1, torch.ones(3))
    message = str(info.value)
    assert "NotImplementedError: no lowering for op frobnicate" in message
    assert "not a C++ compiler problem" in message and "g++" not in message
    assert "SHARDWISE_CPU_GRAPHS=eager" in message


# ----- choosing the strategy ----------------------------------------------------------------------

def test_strategy_choice(monkeypatch):
    acc = CpuAccelerator()
    monkeypatch.delenv(cpu_graphs.CPU_GRAPHS_ENV, raising=False)
    default = acc.graph_strategy()
    assert isinstance(default, CpuCompileStrategy) and default.accelerates
    assert (default.linear, default.mode, default.freezing) == ("cpp", "default", False)
    for value, linear in (("compile", "cpp"), ("onednn", "onednn"), ("inductor", "inductor")):
        monkeypatch.setenv(cpu_graphs.CPU_GRAPHS_ENV, value)
        chosen = acc.graph_strategy()
        assert chosen.linear == linear and chosen.freezing == (linear != "cpp")
    monkeypatch.setenv(cpu_graphs.CPU_GRAPHS_ENV, "frozen")
    frozen = acc.graph_strategy()
    assert (frozen.linear, frozen.freezing) == ("cpp", True)
    monkeypatch.setenv(cpu_graphs.CPU_GRAPHS_ENV, "eager")
    eager = acc.graph_strategy()
    assert type(eager) is GraphStrategy and not eager.accelerates
    monkeypatch.setenv(cpu_graphs.CPU_GRAPHS_ENV, "fast")
    with pytest.raises(ConfigError, match="SHARDWISE_CPU_GRAPHS='fast'"):
        acc.graph_strategy()
    with pytest.raises(ValueError, match="linear 'mkl'"):
        CpuCompileStrategy(linear="mkl")
    with pytest.raises(ValueError, match="mode 'reduce-overhead'"):
        CpuCompileStrategy(mode="reduce-overhead")


# ----- one copy of the weights --------------------------------------------------------------------

def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _own_bytes(engine) -> tuple[int, int]:
    """(bytes of the tensors the compiled graphs hold that share no storage with the model's
    parameters and buffers, bytes of the model's parameters)."""
    module = engine.module
    model_storages = {_storage(t) for t in (*module.parameters(), *module.buffers())}
    graphs = module.base_model.graphs
    held = {}
    for graph in graphs.graphs.values():
        for t in CpuCompileStrategy.constants(graph):
            if _storage(t) not in model_storages:
                held[_storage(t)] = t.untyped_storage().nbytes()
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    return sum(held.values()), params


@pytest.mark.parametrize("arch", families(core=True))
def test_compiled_step_holds_no_copy_of_the_weights(models, arch):
    """The compiled step reads the model's own parameters (graph inputs, laid out once in
    blocks for the C++ GEMM template), so graphs add no second copy of the weights."""
    ref, eager, compiled = models(arch)
    own, params = _own_bytes(compiled)
    assert params > 0 and own <= 0.02 * params, (own, params)
    eager_params = sum(p.numel() * p.element_size() for p in eager.module.parameters())
    assert params <= 1.02 * eager_params  # blocked weights: the same bytes, padding aside
    linears = [m for m in compiled.module.modules() if isinstance(m, torch.nn.Linear)
               or type(m).__name__ == "Conv1D"]
    forwards = [m.__dict__.get("forward") for m in linears]
    forwards = [getattr(f, "original", f) for f in forwards]  # the head: HeadFromGraph(...)
    assert linears and all(isinstance(f, layout.BlockedLinear) for f in forwards)


def test_frozen_step_would_hold_a_copy(monkeypatch):
    """What the check above guards against: a frozen strategy's graph holds its own prepacked
    copy of the weights (about the linear weights' bytes)."""
    monkeypatch.setattr(CpuAccelerator, "graph_strategy",
                        lambda self: CpuCompileStrategy(freezing=True))
    own, params = _own_bytes(_engine("gpt2", enable_graph=True))
    assert own > 0.5 * params, (own, params)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_blocked_matmul_matches_linear(rows):
    """Eager ``blocked_matmul`` (batched over blocks up to 32 rows, one GEMM beyond) equals
    ``F.linear``, with a width that is not a multiple of the block (padded)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 70)
    x = torch.randn(2, rows, 48)
    want = linear(x)
    blocked = layout.block_weight(linear.weight.detach().t())
    assert blocked.shape == (3, 48, layout.BLOCK_N)
    got = layout.blocked_matmul(x, blocked, 70) + linear.bias
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_block_linear_weights_keeps_forward_and_tied_embedding():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    embed = torch.nn.Embedding(70, 16)
    head = torch.nn.Linear(16, 70, bias=False)
    head.weight = embed.weight  # tied
    conv = Conv1D(24, 16)
    f64 = torch.nn.Linear(16, 8).double()
    x, ids = torch.randn(3, 16), torch.tensor([[0, 33, 69]])
    want = (head(x), embed(ids), conv(x), f64(x.double()))
    assert layout.block_linear_weights([head, conv, f64], embed) == 2
    assert head.weight is embed.weight and head.weight.shape == (3, 16, layout.BLOCK_N)
    assert "forward" not in f64.__dict__  # neither fp32 nor 16-bit: left as it is
    got = (head(x), embed(ids), conv(x), f64(x.double()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_block_linear_weights_keeps_the_usual_layout_in_state_dict():
    """A laid-out weight (Linear [N, K], Conv1D [K, N], a head tied to an embedding) is given
    back in its usual layout by ``state_dict``, bit for bit, and a tie stays one tensor."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(70, 16),
                                 "head": torch.nn.Linear(16, 70, bias=False),
                                 "conv": Conv1D(24, 16)})
    model["head"].weight = model["embed"].weight
    want = {k: v.clone() for k, v in model.state_dict().items()}
    assert layout.block_linear_weights([model["head"], model["conv"]], model["embed"]) == 2
    got = model.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert got["head.weight"] is got["embed.weight"]


def _blockable_model() -> torch.nn.ModuleDict:
    """A head tied to an embedding, a Conv1D, a linear with bias and a float64 one (left as it is)."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(70, 16),
                                 "head": torch.nn.Linear(16, 70, bias=False),
                                 "conv": Conv1D(24, 16), "proj": torch.nn.Linear(16, 40),
                                 "f64": torch.nn.Linear(16, 8).double()})
    model["head"].weight = model["embed"].weight
    return model


def _outputs(model, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (model["head"](x), model["embed"](ids), model["conv"](x), model["proj"](x),
            model["f64"](x.double()))


def _patches(model) -> dict[str, tuple]:
    """Per module: its instance-level forward (None when it has none) and state_dict hooks."""
    return {name: (vars(m).get("forward"), dict(m._state_dict_hooks))
            for name, m in model.named_modules()}


def _weights(model) -> dict[str, tuple]:
    """Per parameter: (the Parameter object, shape, stride, contiguous, a copy of its values)."""
    return {name: (p, p.shape, p.stride(), p.is_contiguous(), p.detach().clone())
            for name, p in model.named_parameters(remove_duplicate=False)}


def _assert_given_back(model, patches, weights, outputs, x, ids, scale: float = 1.0) -> None:
    assert _patches(model) == patches  # no instance forward, no hook left behind
    now = _weights(model)
    assert now.keys() == weights.keys()
    for name, (param, shape, stride, contiguous, values) in weights.items():
        p, *_ = now[name]
        assert p is param, name  # the same Parameter objects: optimizers, ties keep working
        assert (p.shape, p.stride(), p.is_contiguous()) == (shape, stride, contiguous), name
        want = values * scale if name != "f64.weight" and name.endswith("weight") else values
        assert torch.equal(p.detach(), want), name
    assert model["head"].weight is model["embed"].weight  # the tie holds
    if scale == 1.0:
        for got, want in zip(_outputs(model, x, ids), outputs):
            assert torch.equal(got, want)


def _blocked_in_a_ledger(model):
    """Lay ``model``'s weights out inside ``Ledger(model).recording()``, as init_inference
    does, then let the ledger drop the weights it no longer needs, as a successful init does:
    the blocked weights are then the only copy."""
    from shardwise.ledger import Ledger

    ledger = Ledger(model)
    with ledger.recording():
        assert layout.block_linear_weights(
            [model["head"], model["conv"], model["proj"], model["f64"]], model["embed"]) == 3
    assert model["proj"].weight.shape == (2, 16, layout.BLOCK_N)
    assert isinstance(vars(model["embed"])["forward"], layout.BlockedEmbedding)
    assert ledger.drop_replaced() > 0  # the plain weights: let go of, not kept for the undo
    assert ledger.held_bytes()["parameters"] == 0
    return ledger


def test_block_linear_weights_records_an_exact_undo_in_the_ledger():
    """Laying weights out records the instance forwards, the state_dict hooks and each
    weight's layout; giving the model back (engine.close()'s ``give_back``) restores the
    forwards, hooks, Parameter objects, shapes, strides and values (bit for bit) and so the
    outputs exactly, with no copy of the plain weights kept meanwhile."""
    model = _blockable_model()
    x, ids = torch.randn(3, 16), torch.tensor([[0, 33, 69]])
    patches, weights = _patches(model), _weights(model)
    with torch.no_grad():
        outputs = _outputs(model, x, ids)
    ledger = _blocked_in_a_ledger(model)
    ledger.give_back()
    with torch.no_grad():
        _assert_given_back(model, patches, weights, outputs, x, ids)
    ledger.give_back()  # a second call changes nothing
    with torch.no_grad():
        _assert_given_back(model, patches, weights, outputs, x, ids)


def test_blocked_layout_undo_rebuilds_from_the_blocked_weights():
    """The recorded undo re-lays each weight from what the model holds when it runs (here
    scaled in place while blocked, so a kept copy of the plain weights would show), not from a
    copy."""
    model = _blockable_model()
    x, ids = torch.randn(3, 16), torch.tensor([[0, 33, 69]])
    patches, weights = _patches(model), _weights(model)
    with torch.no_grad():
        outputs = _outputs(model, x, ids)
    ledger = _blocked_in_a_ledger(model)
    with torch.no_grad():
        for name in ("head", "conv", "proj"):
            model[name].weight.mul_(2)  # in the blocked layout: padding stays zero
    ledger.give_back()
    _assert_given_back(model, patches, weights, outputs, x, ids, scale=2.0)
    with torch.no_grad():
        for name in ("head", "conv", "proj"):
            model[name].weight.div_(2)
        _assert_given_back(model, patches, weights, outputs, x, ids)


def test_block_linear_weights_alone_records_nothing():
    """Called outside init_inference (no ledger recording), it patches and records nothing:
    undoing is then its caller's business, as before."""
    from shardwise import ledger

    model = _blockable_model()
    assert ledger.active() is None
    assert layout.block_linear_weights([model["proj"]]) == 1
    assert isinstance(vars(model["proj"])["forward"], layout.BlockedLinear)


@pytest.mark.parametrize("arch", families(core=True))
def test_save_pretrained_after_graphs_round_trips(models, arch, tmp_path):
    """``save_pretrained`` of a model whose decode step is compiled (weights laid out in blocks)
    writes HF's layout: reloaded, it equals the reference bit for bit."""
    from transformers import AutoModelForCausalLM

    ref, _, compiled = models(arch)
    compiled.module.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    for key, value in ref.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


# ----- private torch APIs behind a version check ----------------------------------------------

def test_private_torch_apis_warn_once_outside_the_checked_versions(monkeypatch):
    """The one module using torch's private APIs names the torch releases it was checked
    against; on another torch it warns once per process, naming itself."""
    from shardwise import _torch_private as private

    first, last = private.CHECKED_TORCH
    assert first <= private.torch_version() <= last  # the installed torch (2.13) is checked
    assert private.torch_version("2.13.0+cpu") == (2, 13)
    assert private.torch_version("2.9.1") == (2, 9) and private.torch_version("nightly") == (0, 0)
    monkeypatch.setattr(private, "_warned", False)
    monkeypatch.setattr(torch, "__version__", f"{last[0]}.{last[1] + 1}.0")
    with pytest.warns(private.UntestedTorchWarning,
                      match=rf"shardwise._torch_private: torch {last[0]}.{last[1] + 1}.0 is "
                            r"outside .*checked against.*SHARDWISE_CPU_GRAPHS=eager"):
        assert private.check_torch_version() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert private.check_torch_version() is False  # once per process: no second warning
    monkeypatch.setattr(torch, "__version__", f"{first[0]}.{first[1]}.0")
    monkeypatch.setattr(private, "_warned", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert private.check_torch_version() is True  # a checked torch: silent


def test_a_missing_private_torch_api_is_a_named_error(monkeypatch):
    """A private name this torch lacks is a TorchInternalsError naming it and the way out, and
    a capture that needs it fails at init as a ConfigError (not an AttributeError mid-step)."""
    from shardwise import _torch_private as private
    import torch._inductor.codecache as codecache

    monkeypatch.delattr(codecache, "PyCodeCache")
    with pytest.raises(private.TorchInternalsError,
                       match=r"no torch._inductor.codecache.PyCodeCache .*shardwise._torch_private"
                             r".*SHARDWISE_CPU_GRAPHS=eager"):
        private.inductor_module_count()
    assert issubclass(private.TorchInternalsError, shardwise.ShardwiseError)
    with pytest.raises(ConfigError, match=r"cannot capture the decode step \(TorchInternalsError: "
                                          r"torch .* has no torch._inductor.codecache.PyCodeCache"):
        _engine("gpt2", enable_graph=True)


def test_the_package_spells_no_private_torch_name_outside_its_one_module():
    """Every private torch name the package uses — a ``torch._*`` module or attribute,
    ``torch._C``, a private op (``torch.ops.aten._*``, ``mkldnn._*``, ``mkl._*``), also through
    a module-level alias — goes through shardwise._torch_private (found in the code's syntax
    tree: docstrings and messages may still name them)."""
    from pathlib import Path

    root = Path(shardwise.__file__).resolve().parent.parent
    offenders = []
    for folder in ("core", "accelerators", "kernels"):
        for path in sorted((root / folder).rglob("*.py")):
            if path.name != "_torch_private.py":
                offenders += [f"{path.relative_to(root)}:{line}: {name}"
                              for line, name in _private_torch_names(path.read_text())]
    assert not offenders, "\n".join(offenders)


def _dotted(node) -> str | None:
    """``a.b.c`` of a Name/Attribute chain (None for anything else)."""
    import ast

    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _private_torch_names(source: str) -> list[tuple[int, str]]:
    """(line, name) of each private torch name the code uses (``torch.x._y``, ``from torch._x
    import``, ``ALIAS._y`` where ``ALIAS = torch...`` at module level)."""
    import ast

    tree = ast.parse(source)
    aliases = {t.id: _dotted(n.value) for n in tree.body if isinstance(n, ast.Assign)
               for t in n.targets if isinstance(t, ast.Name) and _dotted(n.value)
               and _dotted(n.value).startswith("torch.")}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names]
            found += [(node.lineno, n) for n in names if n.startswith("torch._")]
        elif isinstance(node, ast.Attribute) and (name := _dotted(node)) is not None:
            head, _, rest = name.partition(".")
            full = f"{aliases[head]}.{rest}" if head in aliases else name
            parts = full.split(".")
            if parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__")
                                           for p in parts[1:]):
                found.append((node.lineno, full))
    # an attribute chain is walked once per prefix: keep the longest per line
    return sorted({(line, n) for line, n in found
                   if not any(o != n and o.startswith(n + ".") and ol == line
                              for ol, o in found)})


# ----- no recompiles ------------------------------------------------------------------------------

def test_replays_never_recompile(models):
    """Generate after generate, batch sizes in and out of a bucket, with and without padding:
    each bucket's step is compiled once and replayed (dynamo raises on any recompile)."""
    ref, eager, compiled = models("llama")
    strategy = _strategy(compiled)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in (1, 2, 1, 2):
            ids = prompt_ids(batch=batch, length=6 + batch)
            mask = torch.ones_like(ids)
            mask[0, :1] = 0
            _generate(compiled, ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4)
    assert strategy.compiles == len(compiled.module.base_model.graphs.buckets())


# ----- the cache folder and the progress line -----------------------------------------------------

def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    from shardwise import graphs

    monkeypatch.delenv(graphs.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert graphs.cache_root() == (tmp_path / "xdg" / "shardwise").resolve()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert graphs.cache_root() == (tmp_path / "home" / ".cache" / "shardwise").resolve()
    monkeypatch.setenv(graphs.CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert graphs.cache_dir("inductor") == (tmp_path / "mine" / "inductor").resolve()
    assert (tmp_path / "mine" / "inductor").is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(graphs.CACHE_DIR_ENV, str(blocker))
    with pytest.raises(ConfigError, match="SHARDWISE_CACHE_DIR"):
        graphs.cache_dir("inductor")


def _double(x):
    return x * 2 + 1


def test_compiled_code_goes_to_the_user_cache_folder(monkeypatch, tmp_path):
    """Inductor's caches land in shardwise's per-user folder while a capture compiles (not the
    shared /tmp default), the variable is set back afterwards, and a folder the user chose for
    inductor wins."""
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "ours"))
    monkeypatch.delenv(cpu_graphs.INDUCTOR_CACHE_ENV, raising=False)
    CpuCompileStrategy().capture(_double, torch.ones(5))
    assert any((tmp_path / "ours" / "inductor").rglob("*.py"))
    # set back: unset, or inductor's default that torch itself writes there when it needs it
    assert "ours" not in __import__("os").environ.get(cpu_graphs.INDUCTOR_CACHE_ENV, "")
    monkeypatch.setenv(cpu_graphs.INDUCTOR_CACHE_ENV, str(tmp_path / "theirs"))
    CpuCompileStrategy().capture(_double, torch.ones(6))
    assert any((tmp_path / "theirs").rglob("*.py"))


class _Terminal(__import__("io").StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line(caplog):
    from shardwise.graphs import progress

    out = _Terminal()
    with progress("capturing the decode step for batch bucket 4", stream=out, interval=0.01):
        __import__("time").sleep(0.05)
    text = out.getvalue()
    assert text.startswith("shardwise: capturing the decode step for batch bucket 4 ...")
    assert "\rshardwise: capturing the decode step for batch bucket 4: done in" in text
    assert text.endswith("\n") and text.count("\n") == 1  # one line, rewritten in place
    caplog.set_level("INFO", logger="shardwise.graphs")
    with progress("compiling x", stream=__import__("io").StringIO()):
        pass
    assert caplog.records[-2].getMessage() == "shardwise: compiling x ..."
    assert caplog.records[-1].getMessage().startswith("shardwise: compiling x: ")


def test_failed_capture_gives_the_weights_back(monkeypatch):
    """The weights are laid out before the first capture; a capture that then fails leaves the
    model as handed in (original weight shapes, no instance forwards, the same logits)."""
    def fails(self, fn, *args):
        raise RuntimeError("no compiler (injected by the test)")

    monkeypatch.setattr(CpuCompileStrategy, "capture", fails)
    model = tiny_causal_lm("gpt2")
    shapes = {n: p.shape for n, p in model.named_parameters()}
    ids = prompt_ids(batch=1, length=8)
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(ConfigError, match="injected by the test"):
        shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True,
                                 enable_graph=True)
    assert {n: p.shape for n, p in model.named_parameters()} == shapes
    assert not any("forward" in m.__dict__ for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


def test_init_gives_freed_weights_back_to_the_system(monkeypatch):
    """The weights init_inference replaced (here: laid out for the compiled step) are handed
    back to the system once the rollback record lets go of them — glibc would keep their heap
    chunks in the RSS otherwise — and the CPU's release really calls glibc's trim."""
    calls = []
    monkeypatch.setattr(cpu_mod, "return_freed_memory", lambda: calls.append("trim"))
    _engine("llama", enable_graph=True)
    assert calls == ["trim"]
    monkeypatch.undo()
    trim = cpu_mod._malloc_trim()
    assert trim is not None  # glibc (this project's CI): the release is not a no-op
    cpu_mod.return_freed_memory()


def test_quantized_step_compiles_once_per_bucket(monkeypatch):
    """A quantized model's step is compiled with ATen's GEMMs among the candidates from the
    first attempt (inductor lowers ``_weight_int8pack_mm`` through its GEMM selection, which the
    C++ template alone cannot serve): no failed compile first, on every start."""
    attempts = []
    real = CpuCompileStrategy._capture

    def counted(self, fn, inputs, options):
        attempts.append(options.get("max_autotune_gemm_backends"))
        return real(self, fn, inputs, options)

    monkeypatch.setattr(CpuCompileStrategy, "_capture", counted)
    engine = _engine("llama", enable_graph=True, quant={"weight": {"num_bits": 8}})
    strategy = _strategy(engine)
    assert strategy.gemm_backends == "CPP,ATEN"
    assert attempts == ["CPP,ATEN"] * len(engine.module.base_model.graphs.buckets())
    assert strategy.compiles == len(attempts)


# ----- precompiled steps: a later start loads the step instead of tracing it ----------------------

def _steps(engine) -> tuple[int, int]:
    strategy = _strategy(engine)
    return strategy.compiles, strategy.loaded


def test_a_later_start_loads_the_step_and_computes_the_same(monkeypatch, tmp_path):
    """The step compiled by one engine is saved in the per-user store; a second engine of the
    same model loads it (no trace, no compilation) and its greedy tokens and every step's
    logits equal the first engine's, the eager step's (within FP32_ATOL) and HF's tokens."""
    monkeypatch.setattr(precompile, "precompiled_folder", lambda: tmp_path)
    ids = prompt_ids(batch=1, length=8)
    ref = tiny_causal_lm("llama")
    with torch.no_grad():
        ref_tokens = ref.generate(ids, **GREEDY)
    eager_tokens, eager_logits = _generate(_engine("llama"), ids)
    first = _engine("llama", enable_graph=True)
    assert _steps(first) == (1, 0)
    saved = sorted(p.name for p in tmp_path.glob("*.bin"))
    assert len(saved) == 1
    tokens, logits = _generate(first, ids)
    second = _engine("llama", enable_graph=True)
    assert _steps(second) == (0, 1)  # loaded, not compiled
    again_tokens, again_logits = _generate(second, ids)
    assert _steps(second) == (0, 1)  # and replayed without a recompile
    assert torch.equal(again_tokens, ref_tokens) and torch.equal(tokens, ref_tokens)
    assert torch.equal(eager_tokens, ref_tokens)
    assert torch.equal(again_logits, logits)  # the same compiled code: bit for bit
    assert (again_logits - eager_logits).abs().max().item() <= FP32_ATOL
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == saved  # nothing new written


def test_a_checkpoint_start_loads_the_step_of_a_model_handed_in(monkeypatch, tmp_path):
    """The same model handed in from HF and loaded by ``checkpoint=`` share one stored step: the
    engine clears ``requires_grad`` before capture (the step guards on it; a checkpoint's
    parameters never need grad), and ``close()`` gives the user's flags back."""
    (tmp_path / "steps").mkdir()
    monkeypatch.setattr(precompile, "precompiled_folder", lambda: tmp_path / "steps")
    model = tiny_causal_lm("llama")
    model.save_pretrained(tmp_path / "hf")
    assert all(p.requires_grad for p in model.parameters())  # as from_pretrained gives it
    first = shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True,
                                     enable_graph=True)
    assert _steps(first) == (1, 0)
    assert not any(p.requires_grad for p in first.module.parameters())
    assert first.close() is model and all(p.requires_grad for p in model.parameters())
    second = shardwise.init_inference(None, checkpoint=str(tmp_path / "hf"), device="cpu",
                                      dtype=torch.float32, replace_with_kernel_inject=True,
                                      enable_graph=True)
    assert _steps(second) == (0, 1)  # loaded, not compiled


def test_a_changed_model_or_setting_compiles_again(monkeypatch, tmp_path):
    """The key covers what the traced code depends on: another model config (here the norm's
    eps: a constant baked into the code, no tensor shape changes), another compute setting
    (quantized), or precompile turned off, each compile instead of loading the stored step."""
    monkeypatch.setattr(precompile, "precompiled_folder", lambda: tmp_path)
    assert _steps(_engine("llama", enable_graph=True)) == (1, 0)
    model = tiny_causal_lm("llama")
    model.config.rms_norm_eps = 1e-3
    for module in model.modules():
        for name in ("variance_epsilon", "eps"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 1e-3)
    other = shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True,
                                     enable_graph=True)
    assert _steps(other) == (1, 0)
    assert len(list(tmp_path.glob("*.bin"))) == 2  # each stored under its own key
    assert _steps(_engine("llama", enable_graph=True,
                          quant={"weight": {"num_bits": 8}}))[1] == 0
    monkeypatch.setenv(precompile.PRECOMPILE_ENV, "0")
    assert _steps(_engine("llama", enable_graph=True)) == (1, 0)


def test_step_key_follows_what_the_code_depends_on():
    """step_key: equal for an equal step built again, different for another scalar attribute,
    tensor shape or dtype the step reads, other inductor options or other example inputs."""
    def step_of(module):
        def step(x):
            return module(x)
        return step

    def linear(n=4, dtype=torch.float32):
        torch.manual_seed(0)
        return torch.nn.Linear(n, 3, dtype=dtype)

    x = torch.ones(2, 4)
    base = precompile.step_key(step_of(linear()), (x,), {"a": 1})
    assert precompile.step_key(step_of(linear()), (x,), {"a": 1}) == base
    changed = linear()
    changed.in_features = 5  # a scalar attribute (e.g. eps, heads) the code could bake in
    keys = {precompile.step_key(step_of(changed), (x,), {"a": 1}),
            precompile.step_key(step_of(linear(5)), (x,), {"a": 1}),
            precompile.step_key(step_of(linear(dtype=torch.float64)), (x,), {"a": 1}),
            precompile.step_key(step_of(linear()), (x,), {"a": 2}),
            precompile.step_key(step_of(linear()), (torch.ones(3, 4),), {"a": 1})}
    assert base not in keys and len(keys) == 5


def test_step_key_ignores_how_a_config_was_read():
    """A model read from a GGUF file and the same model reloaded from shardwise's checkpoint:
    their configs differ only in provenance (a GgufConfig object against a dict of it,
    ``_is_quantized``, the order the fields were set in), so their steps share one key; a
    config value the step could read still changes it."""
    from transformers import LlamaConfig
    from transformers.utils.quantization_config import GgufConfig

    def step_of(config):
        def step(x):
            return x * config.rms_norm_eps
        return step

    read = LlamaConfig(hidden_size=64, rms_norm_eps=1e-5)
    read.quantization_config = GgufConfig(gguf_file="model.gguf")
    read._is_quantized = True
    reloaded = LlamaConfig(rms_norm_eps=1e-5, hidden_size=64)
    reloaded.quantization_config = {"gguf_file": "model.gguf", "quant_method": "gguf"}
    x = torch.ones(2)
    key = precompile.step_key(step_of(read), (x,), {})
    assert precompile.step_key(step_of(reloaded), (x,), {}) == key
    assert precompile.step_key(step_of(LlamaConfig(hidden_size=64, rms_norm_eps=1e-6)),
                               (x,), {}) != key


def test_a_stale_or_broken_store_entry_is_never_used(monkeypatch, tmp_path, caplog):
    """A stored step whose traced sources changed since (their digest in the side file), or
    whose file is damaged, is not loaded: the step compiles again (and is stored again)."""
    monkeypatch.setattr(precompile, "precompiled_folder", lambda: tmp_path)
    assert _steps(_engine("gpt2", enable_graph=True)) == (1, 0)
    (binary,) = tmp_path.glob("*.bin")
    meta = binary.with_suffix(".json")
    import json

    record = json.loads(meta.read_text())
    assert any(name.startswith("shardwise.") for name in record["sources"])
    name = next(iter(record["sources"]))
    record["sources"][name] = "0" * 64  # as if that module had been edited since
    meta.write_text(json.dumps(record))
    with caplog.at_level("INFO", logger="shardwise"):
        assert _steps(_engine("gpt2", enable_graph=True)) == (1, 0)
    assert "stale" in caplog.text and name in caplog.text
    binary.write_bytes(binary.read_bytes()[:100])  # damaged (the entry was written again)
    caplog.clear()
    with caplog.at_level("INFO", logger="shardwise"):
        assert _steps(_engine("gpt2", enable_graph=True)) == (1, 0)
    assert "could not be loaded" in caplog.text
    assert _steps(_engine("gpt2", enable_graph=True)) == (0, 1)  # the rewritten entry serves


def test_store_files_are_private(monkeypatch, tmp_path):
    """The store lives in the user's cache folder (mode 0700) and its files are the user's
    alone: another user could otherwise plant code that this process would run. A plain
    function's step is stored and loaded too."""
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "root"))
    folder = _USER_FOLDER()
    assert folder == (tmp_path / "root" / "cpu-steps").resolve()
    assert folder.stat().st_mode & 0o777 == 0o700
    monkeypatch.setattr(precompile, "precompiled_folder", lambda: folder)
    first, again = CpuCompileStrategy(), CpuCompileStrategy()
    first.capture(_double, torch.ones(7))
    files = list(folder.iterdir())
    assert files and all(f.stat().st_mode & 0o077 == 0 for f in files)
    graph = again.capture(_double, torch.ones(7))
    assert (first.compiles, first.loaded, again.compiles, again.loaded) == (1, 0, 0, 1)
    assert torch.equal(graph(torch.full((7,), 3.0)), torch.full((7,), 7.0))


_PROBE_SCRIPT = """
import json, sys
from shardwise import _torch_private as private
import torch._inductor.cpu_vec_isa as isa
concurrent = private.probe_vec_isa_concurrently() if sys.argv[1] == "threads" else None
print(json.dumps({"picked": str(isa.pick_vec_isa()), "concurrent": concurrent,
                  "valid": [str(i) for i in isa.valid_vec_isa_list()]}))
"""


def test_concurrent_simd_probe_finds_what_inductors_own_probe_finds(tmp_path):
    """The capture probes inductor's SIMD ISAs on a thread per ISA while dynamo traces (about
    5 s less on a first start here): it must pick and accept exactly what inductor's own
    one-at-a-time probe does. Fresh interpreters (a process probes once), one new inductor
    cache folder: the threaded probe builds into it, inductor's probe then loads those
    builds in its own checks."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    found = {}
    for how in ("threads", "inductor"):
        out = subprocess.run([sys.executable, "-c", _PROBE_SCRIPT, how], env=env, text=True,
                             capture_output=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        found[how] = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["threads"]["concurrent"] == found["threads"]["picked"]
    assert found["threads"]["valid"] == found["inductor"]["valid"]
    assert found["threads"]["picked"] == found["inductor"]["picked"]


def test_capture_starts_the_simd_probe_once_and_waits_for_it(monkeypatch):
    """A capture that compiles starts the background probe (at most once per process) and
    its backend waits for it before inductor lowers the step."""
    calls = []
    monkeypatch.setattr(cpu_graphs._VecIsaProbe, "_thread", None)
    monkeypatch.setattr(cpu_graphs.private, "vec_isa_probed", lambda: None)
    monkeypatch.setattr(cpu_graphs.precompile, "vec_isa_known", lambda folder: False)
    monkeypatch.setattr(cpu_graphs.private, "probe_vec_isa_concurrently",
                        lambda: calls.append("probe") or "avx512")
    waited = []
    real_wait = cpu_graphs._VecIsaProbe.wait.__func__
    monkeypatch.setattr(cpu_graphs._VecIsaProbe, "wait",
                        classmethod(lambda cls: waited.append(1) or real_wait(cls)))
    monkeypatch.setenv(precompile.PRECOMPILE_ENV, "0")
    for _ in range(2):
        graph = CpuCompileStrategy().capture(_double, torch.ones(5))
        assert torch.equal(graph(torch.full((5,), 2.0)), torch.full((5,), 5.0))
    assert calls == ["probe"] and len(waited) == 2


def test_reassembled_reuses_one_buffer_up_to_its_cap(monkeypatch):
    """The eager prompt's reassembled weight: a view of one per-thread buffer reused across
    calls (no page faults per call), exact; a weight over ``SCRATCH_MAX_BYTES`` gets a
    transient tensor instead, so no thread keeps a head-sized buffer."""
    import threading

    monkeypatch.setattr(layout, "_scratch", threading.local())
    small, big = torch.randn(40, 16), torch.randn(100, 16)  # [K, N] each
    a = layout.reassembled(layout.block_weight(small), 16)
    b = layout.reassembled(layout.block_weight(small.flip(0)), 16)
    assert torch.equal(b, small.flip(0)) and a.data_ptr() == b.data_ptr()  # one buffer
    monkeypatch.setattr(layout, "SCRATCH_MAX_BYTES", 40 * 32 * 4)  # the small weight's blocks
    c = layout.reassembled(layout.block_weight(big), 16)
    assert torch.equal(c, big) and c.data_ptr() != b.data_ptr()
    assert layout._scratch.buf.numel() == 40 * 32 * 4  # not grown for the big one
