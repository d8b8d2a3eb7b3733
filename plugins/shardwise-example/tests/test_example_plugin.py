"""The example plugin passes shardwise's accelerator conformance suite.

A vendor keeps this file as is, changing the name (and dropping accelerator_env, which only
switches on the demonstration device).
"""

import torch

from shardwise.kernel_registry import registry
from shardwise.kernels import reference
from shardwise.testing import AcceleratorConformance
from shardwise_example import ENABLE_ENV, ExampleAccelerator
from shardwise_example.kernels import rms_norm


class TestExampleConformance(AcceleratorConformance):
    accelerator_name = "example"
    accelerator_env = {ENABLE_ENV: "1"}

    def test_own_rms_norm_is_resolved(self):
        """Our backend, not the reference, runs rms_norm on this device."""
        for dtype in ExampleAccelerator.supported_dtypes:
            assert registry.resolve("rms_norm", self.accelerator, dtype).backend == "example"


def test_rms_norm_matches_reference_without_residual():
    x, w = torch.randn(2, 5, 32), torch.rand(32) + 0.5
    out, h = rms_norm(x, w, 1e-6)
    ref_out, ref_h = reference.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, ref_out)
    assert h is x and ref_h is x
