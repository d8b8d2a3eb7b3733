"""Test helpers shipped with shardwise, for built-in and third-party plugins alike.

The accelerator conformance suite is what every accelerator plugin must pass::

    from shardwise.testing import AcceleratorConformance

    class TestMine(AcceleratorConformance):
        accelerator_name = "mine"

or, without pytest, ``shardwise.testing.run_conformance("mine")`` (also ``shardwise conformance
mine`` on the command line). Importing this package does not import pytest.
"""

from .conformance import (CHECKS, DTYPE_TOLERANCES, AcceleratorConformance,
                          CheckResult, CheckSkipped, accelerator_under_test, check_communicator,
                          check_communicator_2_ranks,
                          check_device_round_trip, check_dtypes_compute, check_graph_strategy,
                          check_kernel_parity, check_launch_env, check_memory, check_metadata,
                          run_check, run_conformance)

__all__ = [
    "CHECKS", "DTYPE_TOLERANCES", "AcceleratorConformance", "CheckResult",
    "accelerator_under_test",
    "CheckSkipped", "check_communicator", "check_communicator_2_ranks",
    "check_device_round_trip", "check_dtypes_compute", "check_graph_strategy",
    "check_kernel_parity", "check_launch_env", "check_memory", "check_metadata", "run_check",
    "run_conformance",
]
