"""Graphs with offload (``enable_graph`` + ``offload=``, issue 17): the injected decode step
captured one layer at a time, the ring's waits between the graphs (shardwise.offload.graphs).

On this CPU the default graph strategy compiles each layer's step with its weights as inputs
(``weight_binding="inputs"``): one compiled step per layer and batch bucket serves the layer from
whichever ring slot holds it. A stand-in strategy that, like a CUDA graph, reads the weights at
the addresses it captured (``"addresses"``) checks the per-slot path: one graph per layer and
slot, each replayed only on the slot it was captured on. Every case compares greedy tokens (and
each step's scores) with the same model resident and with offload run eagerly. The
``gpu``-marked cases run the CUDA path (the ``"cpu"`` tier: pinned host blobs copied into device
slots, CUDA graphs per slot) where a GPU exists.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

import shardwise
from models import prompt_ids, tiny_causal_lm
from shardwise.accelerator import GraphStrategy
from shardwise.errors import ConfigError
from shardwise.graphs import StaticGraph, static_copies, static_outputs
from shardwise.offload.graphs import OffloadDecodeGraphs, enable_offload_graphs
from shardwise.offload.transform import offload_units
from tp_harness import TP, case, table_fixture

#: scores of the per-layer graphs against eager runs (CPU: inductor's fused C++ loops sum in
#: another order than eager kernels; measured 1.2e-7 on these models)
ATOL = 1e-4
NEW_TOKENS = 10
GREEDY = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
              pad_token_id=0, output_scores=True, return_dict_in_generate=True)
#: (arch, quant bits or None)
CASES = [("llama", None), ("llama", 8), ("gpt2", None), ("gpt2", 8), ("mixtral", None)]


def _settings(bits: int | None, device: str = "cpu") -> dict:
    kw = {"device": device, "dtype": torch.float32, "replace_with_kernel_inject": True}
    if bits:
        kw["quant"] = {"weight": {"num_bits": bits}}
    return kw


def _nvme(path, k: int) -> dict:
    return {"device": "nvme", "nvme_path": str(path), "buffer_count": k}


def _generate(engine, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, scores [steps, batch, vocab]) of a greedy generate."""
    out = engine.generate(ids, **GREEDY)
    return out.sequences.cpu(), torch.stack(out.scores).float().cpu()


def _diff(scores: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |scores - ref| where ``ref`` is finite; the masked scores (-inf: the EOS token
    held back by min_new_tokens) must be masked in both."""
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(scores)), "different scores masked"
    return float((scores - ref)[finite].abs().max())


def _with_graphs(engine, strategy: GraphStrategy | None = None) -> OffloadDecodeGraphs:
    """Per-layer graphs on an offloaded engine built with enable_graph=False, as the engine's
    graph step does with enable_graph=True (parameters no-grad first, as it sets them);
    ``strategy``: stands in for the accelerator's."""
    for param in engine.module.parameters():
        param.requires_grad_(False)
    accelerator = engine.accelerator
    if strategy is not None:
        accelerator = type(accelerator)()
        accelerator.graph_strategy = lambda: strategy
    enable_offload_graphs(engine.module, accelerator, engine.offload)
    graphs = engine._stack.graphs
    assert isinstance(graphs, OffloadDecodeGraphs)
    return graphs


def _layer_slots(engine, graphs: OffloadDecodeGraphs) -> dict[int, set[int]]:
    """layer index → the ring slots it ran from (the ring's acquire events)."""
    by_piece = {p: layer for layer, p in graphs.pieces.items()}
    seen: dict[int, set[int]] = {}
    for kind, piece, slot in engine.offload.events:
        if kind == "acquire" and piece in by_piece:
            seen.setdefault(by_piece[piece], set()).add(slot)
    return seen


def _assert_in_slots(engine) -> None:
    """Every streamed tensor the model holds is a view of a ring slot (no resident copy)."""
    slots = engine.offload.ring.loader.slots
    ranges = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in slots]
    for unit in offload_units(engine.module, engine.plan, engine._stack):
        for ref in unit.tensors:
            ptr = ref.current().untyped_storage().data_ptr()
            assert any(lo <= ptr < hi for lo, hi in ranges), f"{unit.name}.{ref.key} resident"


# ----- the CPU's compiled layers (weights as inputs) ----------------------------------------------

@pytest.mark.parametrize("arch,bits", CASES, ids=[f"{a}-{f'int{b}' if b else 'fp32'}"
                                                   for a, b in CASES])
def test_per_layer_graphs_match_the_resident_model_and_eager_offload(arch, bits, tmp_path):
    ids = prompt_ids(batch=2, length=8)
    ref_tokens, ref_scores = _generate(
        shardwise.init_inference(tiny_causal_lm(arch), **_settings(bits)), ids)
    # 4 units (embedding, 2 layers, head) through 3 slots: each pass shifts the slots by one
    eager = shardwise.init_inference(tiny_causal_lm(arch), offload=_nvme(tmp_path, 3),
                                     **_settings(bits))
    eager_tokens, eager_scores = _generate(eager, ids)
    eager.close()
    engine = shardwise.init_inference(tiny_causal_lm(arch), offload=_nvme(tmp_path, 3),
                                      **_settings(bits))
    graphs = _with_graphs(engine)
    layers = len(engine._stack.parts.layers)
    assert graphs.per_slot is False and graphs.captures == layers  # the trial: bucket 1
    engine.offload.reset_stats()
    tokens, scores = _generate(engine, ids)
    print(f"{arch} {bits or 32}-bit: |scores - resident| {_diff(scores, ref_scores):.2e}, "
          f"|scores - eager offload| {_diff(scores, eager_scores):.2e}")
    assert torch.equal(tokens, ref_tokens) and torch.equal(tokens, eager_tokens)
    assert _diff(scores, ref_scores) <= ATOL
    assert _diff(scores, eager_scores) <= ATOL
    # one compiled step per layer and bucket (1: the trial, 2: this batch), whatever the slot
    assert graphs.captures == 2 * layers and set(graphs.graphs) >= {1, 2}
    assert all(len(slots) > 1 for slots in _layer_slots(engine, graphs).values())
    assert engine.offload.stats()["passes"] >= NEW_TOKENS
    _assert_in_slots(engine)
    assert "one per layer (2, weights read as inputs" in engine.offload.graphs


def test_close_after_graphs_gives_back_a_model_that_generates_the_same(tmp_path):
    ids = prompt_ids(batch=1, length=6)
    model = tiny_causal_lm("llama")
    ref_tokens, _ = _generate(shardwise.init_inference(tiny_causal_lm("llama"), **_settings(None)),
                              ids)
    engine = shardwise.init_inference(model, offload=_nvme(tmp_path, 2), **_settings(None))
    graphs = _with_graphs(engine)
    assert torch.equal(_generate(engine, ids)[0], ref_tokens)
    engine.close()
    assert graphs.graphs == {}  # the stack freed them
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref_tokens)


def test_an_eager_strategy_captures_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SHARDWISE_CPU_GRAPHS", "eager")
    engine = shardwise.init_inference(tiny_causal_lm("llama"), offload=_nvme(tmp_path, 2),
                                      **_settings(None))
    with caplog.at_level(logging.INFO, logger="shardwise"):
        strategy = enable_offload_graphs(engine.module, engine.accelerator, engine.offload)
    assert not strategy.accelerates and engine._stack.graphs is None
    assert engine.offload.graphs is None
    assert "runs the decode step eagerly" in caplog.text


# ----- graphs bound to addresses (as CUDA graphs): one per layer and slot -------------------------

class AddressBound(GraphStrategy):
    """Stands in for a CUDA graph on CPU tensors: a replay runs the function again, but only on
    the weights at the addresses the capture saw (anything else fails the test, as a CUDA graph
    would silently compute with whatever those addresses hold by then)."""

    name = "address_bound"
    accelerates = True  # weight_binding: the default, "addresses"

    def __init__(self) -> None:
        self.captured: list[tuple[int, tuple[int, ...]]] = []

    @staticmethod
    def _layer(fn):
        forward = next(c.cell_contents for c in fn.__closure__
                       if hasattr(c.cell_contents, "__self__"))
        return forward.__self__

    def capture(self, fn, *example_args):
        layer = self._layer(fn)
        bound = tuple(t.data_ptr() for t in layer.parameters())
        self.captured.append((layer.index, bound))
        inputs = static_copies(example_args, "cpu")
        outputs = static_outputs(fn(*inputs))

        def replay() -> None:
            now = tuple(t.data_ptr() for t in layer.parameters())
            assert now == bound, f"layer {layer.index} replayed on weights it was not captured on"
            for static, value in zip(outputs, fn(*inputs)):
                static.copy_(value)
        return StaticGraph(replay, inputs, outputs)


def test_address_bound_graphs_are_captured_per_layer_and_slot(tmp_path):
    ids = prompt_ids(batch=2, length=8)
    ref_tokens, ref_scores = _generate(
        shardwise.init_inference(tiny_causal_lm("llama"), **_settings(None)), ids)
    engine = shardwise.init_inference(tiny_causal_lm("llama"), offload=_nvme(tmp_path, 3),
                                      **_settings(None))
    strategy = AddressBound()
    graphs = _with_graphs(engine, strategy)
    assert graphs.per_slot is True
    engine.offload.reset_stats()
    tokens, scores = _generate(engine, ids)
    assert torch.equal(tokens, ref_tokens) and _diff(scores, ref_scores) <= ATOL
    ran_from = _layer_slots(engine, graphs)  # the prompt's eager forward included
    # one graph per (bucket, layer, slot) used, each captured on that slot's addresses
    keys = {(bucket, *key) for bucket, per in graphs.graphs.items() for key in per}
    assert graphs.captures == len(keys) == len(strategy.captured)
    decode = {(layer, slot) for bucket, layer, slot in keys if bucket == 2}
    assert decode <= {(layer, slot) for layer, slots in ran_from.items() for slot in slots}
    for layer in ran_from:  # the slots rotate: a layer's decode steps replay several graphs
        assert len({slot for index, slot in decode if index == layer}) > 1
    assert "one per layer and ring slot" in engine.offload.graphs


def test_the_serving_slots_run_on_per_layer_graphs_too(tmp_path):
    """Continuous batching (shardwise.serve's slot runner: its own caches and graph keys per
    bucket) on an offloaded engine with address-bound layer graphs: each sequence gets its HF
    greedy tokens."""
    from shardwise.serve.runner import SlotRunner
    from slot_scenario import check_against_hf, scenario

    engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                      replace_with_kernel_inject=True, max_tokens=64,
                                      offload=_nvme(tmp_path, 3))
    graphs = _with_graphs(engine, AddressBound())
    runner = SlotRunner(engine, max_batch=3, max_tokens=32)
    try:
        runner.warmup()
        assert check_against_hf(tiny_causal_lm("llama"), scenario(runner)) <= ATOL
        slot_keys = [key for key in graphs.graphs if not isinstance(key, int)]
        assert len(slot_keys) == 3 and all(graphs.graphs[key] for key in slot_keys)
    finally:
        runner.close()


def test_a_graph_per_layer_alone_would_replay_on_the_wrong_slot(tmp_path):
    """The per-slot key is what keeps address-bound replays right: keyed by layer alone, the
    stand-in catches a replay on a slot the graph was not captured on."""
    engine = shardwise.init_inference(tiny_causal_lm("llama"), offload=_nvme(tmp_path, 3),
                                      **_settings(None))
    graphs = _with_graphs(engine, AddressBound())
    graphs.per_slot = False
    with pytest.raises(AssertionError, match="replayed on weights it was not captured on"):
        engine.generate(prompt_ids(batch=1, length=6), max_new_tokens=6, do_sample=False,
                        pad_token_id=0)


def test_a_strategy_that_cannot_capture_fails_at_init_with_its_reason(tmp_path):
    class Broken(GraphStrategy):
        name, accelerates, weight_binding = "broken", True, "inputs"

        def capture(self, fn, *args):
            raise RuntimeError("no capture today")
    engine = shardwise.init_inference(tiny_causal_lm("llama"), offload=_nvme(tmp_path, 2),
                                      **_settings(None))
    with pytest.raises(ConfigError, match="'broken' cannot capture a layer of the decode step "
                                          "\\(RuntimeError: no capture today\\); run with "
                                          "enable_graph=False"):
        _with_graphs(engine, Broken())
    assert engine._stack.graphs is None


# ----- tensor parallelism: each rank captures its shard's layers --------------------------------

def _tp_case(rank: int, arch: str, bits: int | None, store: str) -> dict:
    os.makedirs(store, exist_ok=True)  # this case's own: the two ranks' stores side by side
    ids = prompt_ids(batch=2, length=8)
    mine = ids if rank == 0 else torch.zeros_like(ids)  # the engine broadcasts rank 0's inputs
    plain = {k: v for k, v in GREEDY.items() if k not in ("output_scores",
                                                          "return_dict_in_generate")}
    resident = shardwise.init_inference(tiny_causal_lm(arch), **_settings(bits), **TP)
    ref_tokens = resident.generate(mine, **plain)
    engine = shardwise.init_inference(tiny_causal_lm(arch), offload=_nvme(store, 3),
                                      **_settings(bits), **TP)
    graphs = _with_graphs(engine)
    tokens = engine.generate(mine, **plain)
    return dict(tokens_equal=torch.equal(tokens, ref_tokens), tokens=tokens.tolist(),
                captures=graphs.captures, layers=len(engine._stack.parts.layers),
                per_slot=graphs.per_slot, path=engine.offload.path)


TP_TABLE = {"llama": ("llama", None), "gpt2-int8": ("gpt2", 8)}
tp_ranks = table_fixture(_tp_case, TP_TABLE, "offload-graphs-tp", deadline_s=900,
                         case_dirs=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TP_TABLE))
def test_tp2_each_rank_captures_its_layers_and_matches_resident_tp(tp_ranks, name):
    r0, r1 = case(tp_ranks, name)
    for r in (r0, r1):
        assert r["tokens_equal"], r
        assert not r["per_slot"] and r["captures"] == 2 * r["layers"]  # buckets 1 and 2
    assert r0["tokens"] == r1["tokens"] and r0["path"] != r1["path"]


# ----- through init_inference (the engine's graph step) -------------------------------------------

def test_init_inference_captures_per_layer_and_says_so(tmp_path, caplog):
    ids = prompt_ids(batch=1, length=6)
    ref_tokens, _ = _generate(shardwise.init_inference(tiny_causal_lm("gpt2"), **_settings(None)),
                              ids)
    with caplog.at_level(logging.INFO, logger="shardwise"):
        engine = shardwise.init_inference(tiny_causal_lm("gpt2"), offload=_nvme(tmp_path, 3),
                                          enable_graph=True, **_settings(None))
    assert isinstance(engine._stack.graphs, OffloadDecodeGraphs)
    assert "decode step captured per layer with cpu_compile" in caplog.text
    assert engine.offload.graphs and engine.offload.graphs in caplog.text
    assert torch.equal(_generate(engine, ids)[0], ref_tokens)


# ----- CUDA: pinned host blobs, one CUDA graph per layer and ring slot ----------------------------

GPU_CASES = [("llama", None), ("gpt2", None), ("llama", 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("arch,bits", GPU_CASES, ids=[f"{a}-{f'int{b}' if b else 'fp32'}"
                                                       for a, b in GPU_CASES])
def test_cuda_graphs_per_slot_over_pinned_host_memory(arch, bits):
    ids = prompt_ids(batch=2, length=8).cuda()
    offload = {"device": "cpu", "pin_memory": True, "buffer_count": 3}
    ref_tokens, ref_scores = _generate(
        shardwise.init_inference(tiny_causal_lm(arch), **_settings(bits, "cuda")), ids)
    eager = shardwise.init_inference(tiny_causal_lm(arch), offload=offload,
                                     **_settings(bits, "cuda"))
    eager_tokens, eager_scores = _generate(eager, ids)
    eager.close()
    engine = shardwise.init_inference(tiny_causal_lm(arch), offload=offload,
                                      **_settings(bits, "cuda"))
    assert engine.offload.ring.loader.slots[0].is_cuda
    graphs = _with_graphs(engine)
    assert graphs.per_slot is True and graphs.strategy.name == "cuda_graph"
    engine.offload.reset_stats()
    tokens, scores = _generate(engine, ids)
    assert torch.equal(tokens, ref_tokens) and torch.equal(tokens, eager_tokens)
    assert _diff(scores, eager_scores) <= 1e-3
    assert _diff(scores, ref_scores) <= 1e-3
    ran_from = _layer_slots(engine, graphs)
    assert all(len(slots) > 1 for slots in ran_from.values())
    keys = {(bucket, *key) for bucket, per in graphs.graphs.items() for key in per}
    assert graphs.captures == len(keys)
    _assert_in_slots(engine)


@pytest.mark.gpu
def test_cuda_init_inference_with_offload_and_graphs():
    """Through init_inference, on CUDA."""
    ids = prompt_ids(batch=1, length=6).cuda()
    ref_tokens, _ = _generate(shardwise.init_inference(tiny_causal_lm("llama"),
                                                       **_settings(None, "cuda")), ids)
    engine = shardwise.init_inference(tiny_causal_lm("llama"), enable_graph=True,
                                      offload={"device": "cpu", "buffer_count": 2},
                                      **_settings(None, "cuda"))
    assert isinstance(engine._stack.graphs, OffloadDecodeGraphs)
    assert torch.equal(_generate(engine, ids)[0], ref_tokens)
