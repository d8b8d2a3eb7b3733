"""Shared fixtures. Triton kernels run under its interpreter when no GPU is present; this must be
set before triton is first imported."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shardwise.plugins import refresh_plugins  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """GPU tests run wherever a GPU exists and are skipped (with the reason) elsewhere."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on a GPU machine to exercise it)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_plugins():
    """Re-read entry points before and after a test that changes what is installed."""
    refresh_plugins()
    yield
    refresh_plugins()


@pytest.fixture(scope="module")
def triton_device() -> str:
    """The device Triton kernels run on here: the GPU, else the CPU under TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    pytest.skip("no GPU and TRITON_INTERPRET is not set (conftest sets it before triton)")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: one thread avoids oversubscription stalls (a
    module opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Fail the test if ``shardwise bench`` loads a model, measures the bandwidth or launches
    ranks (for its bad-input tests: everything is checked before)."""
    from shardwise.bench import runner, session

    def forbidden(*args, **kwargs):
        raise AssertionError("heavy work started before the input was validated")

    monkeypatch.setattr(runner, "load", forbidden)
    monkeypatch.setattr(session, "measure_bandwidth", forbidden)
    monkeypatch.setattr(session, "run_ranks", forbidden)
