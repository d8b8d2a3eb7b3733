"""Graph strategies standing in for a device's graphs, shared by the test files that need one
(test_inject.py, test_inject_tp.py, the serving tests): a test module never imports another
test module."""

from __future__ import annotations

import torch

from shardwise.accelerator import GraphStrategy
from shardwise.graphs import StaticGraph, static_copies, static_outputs


class ReplayOnCpu(GraphStrategy):
    """An accelerating strategy on CPU tensors: it replays by calling the function on the static
    inputs, so the graph-safe decode step (static cache, index_copy_, masked SDPA, static
    buffers per batch size) is exercised without a GPU."""

    name = "replay_on_cpu"
    accelerates = True
    captures = 0

    def capture(self, fn, *example_args):
        inputs = static_copies(example_args, "cpu")
        outputs = static_outputs(fn(*inputs))
        type(self).captures += 1

        def replay():
            new = fn(*inputs)
            for static, value in zip((outputs,) if isinstance(outputs, torch.Tensor) else outputs,
                                     (new,) if isinstance(new, torch.Tensor) else new):
                static.copy_(value)
        return StaticGraph(replay, inputs, outputs)


class CountingReplay(ReplayOnCpu):
    """ReplayOnCpu that also counts the steps it replays (calls of the captured function
    beyond the one each capture makes)."""

    calls = 0

    def capture(self, fn, *example_args):
        def counted(*args):
            type(self).calls += 1
            return fn(*args)
        return super().capture(counted, *example_args)


class RecordedReplay(ReplayOnCpu):
    """Replays what it recorded, as a CUDA graph does (``replays_host_code`` False): capture
    traces the function into its tensor ops (``make_fx``), so a value Python read from a
    tensor at capture (``.tolist()``, ``int(t)``, a branch on it) is a constant at every
    replay — the captured step is right only where every such read happens inside an op
    that reads it as it runs (a kernel reading its inputs on the device)."""

    name = "recorded_replay"
    replays_host_code = False

    def capture(self, fn, *example_args):
        from torch.fx.experimental.proxy_tensor import make_fx

        inputs = static_copies(example_args, "cpu")
        with torch.inference_mode(False):
            recorded = make_fx(fn)(*inputs)
        return super().capture(recorded, *inputs)


def replays() -> int:
    """Steps replayed by every CountingReplay so far."""
    return CountingReplay.calls - CountingReplay.captures


def engine_maker(max_tokens: int = 64):
    """``(get, made)``: ``get(arch, graphs)`` builds (once per pair) the HF reference and an
    injected CPU engine of the tiny ``arch``, with a CountingReplay strategy when ``graphs``;
    ``made`` holds them (clear it when done)."""
    import shardwise
    from shardwise.accelerators.cpu import CpuAccelerator
    from models import tiny_causal_lm

    made = {}

    def get(arch: str, graphs: bool):
        if (arch, graphs) not in made:
            original = CpuAccelerator.graph_strategy
            if graphs:
                CpuAccelerator.graph_strategy = lambda self: CountingReplay()
            try:
                engine = shardwise.init_inference(tiny_causal_lm(arch), device="cpu",
                                                  replace_with_kernel_inject=True,
                                                  enable_graph=graphs, max_tokens=max_tokens)
            finally:
                CpuAccelerator.graph_strategy = original
            made[arch, graphs] = (tiny_causal_lm(arch), engine)
        return made[arch, graphs]
    return get, made
