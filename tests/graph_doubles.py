"""Graph strategies standing in for a device's graphs, shared by the test files that need one
(test_inject.py, test_inject_tp.py): a test module never imports another test module."""

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
