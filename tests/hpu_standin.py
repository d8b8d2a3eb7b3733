"""The Intel Gaudi bridge stand-in (tests/fake_habana/, see its README.md) as a pytest fixture.

``standin`` copies the stand-in's ``habana_frameworks`` into ``tmp_path``, writes the torch
version it was "built for" (this torch's, so the bridge's version check passes), puts it first
on ``sys.path`` with the launch variables cleared and lazy mode on, and yields a
:class:`Standin`. Everything the bridge registers in torch at import (``torch.hpu``, the
``hpu_backend`` dynamo backend) is removed again afterwards, so the next test imports it afresh
under its own environment, as a new process would.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

SOURCE = Path(__file__).resolve().parent / "fake_habana" / "habana_frameworks"
#: A real Gaudi runtime must not be replaced by the stand-in (its C extension cannot be re-imported).
HAS_GAUDI_RUNTIME = importlib.util.find_spec("habana_frameworks") is not None
#: Variables the bridge or the HPU accelerator read; cleared for each test.
HPU_ENV = ("HABANA_VISIBLE_MODULES", "HLS_MODULE_ID", "PT_HPU_ENABLE_LAZY_COLLECTIVES",
           "PT_HPU_LAZY_ACC_PAR_MODE", "PT_HPU_ENABLE_REFINE_DYNAMIC_SHAPES", "LOCAL_RANK",
           "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "ID")


@dataclass
class Standin:
    """Where the stand-in lives (``root`` goes on ``sys.path`` / ``PYTHONPATH``)."""

    root: Path

    def bridge(self, name: str = "habana_frameworks.torch"):
        """Import a module of the stand-in (``habana_frameworks.torch.hpu`` ...)."""
        return importlib.import_module(name)

    def set_required_torch(self, version: str) -> None:
        """Make the stand-in "built for" torch ``version`` (its import then fails on a mismatch)."""
        (self.root / "habana_frameworks" / "torch" / "required_version.txt").write_text(version)


def install(root: Path) -> Standin:
    """Copy the stand-in under ``root`` (built for this torch); returns it."""
    shutil.copytree(SOURCE, root / "habana_frameworks")
    standin = Standin(root)
    standin.set_required_torch(torch.__version__.split("+")[0])
    return standin


def forget() -> None:
    """Drop the stand-in's modules and what it registered in torch at import."""
    for name in [m for m in sys.modules if m.split(".")[0] == "habana_frameworks"]:
        del sys.modules[name]
    if hasattr(torch, "hpu"):
        delattr(torch, "hpu")
    sys.modules.pop("torch.hpu", None)
    from torch._dynamo.backends import registry

    registry._COMPILER_FNS.pop("hpu_backend", None)  # private: re-registering raises
    registry._BACKENDS.pop("hpu_backend", None)


@pytest.fixture
def standin(tmp_path, monkeypatch, fresh_plugins):
    """The stand-in on ``sys.path``, lazy mode, no launch variables; see the module docstring."""
    if HAS_GAUDI_RUNTIME:
        pytest.skip("the real Intel Gaudi runtime is installed; the stand-in would shadow it")
    forget()
    found = install(tmp_path / "standin")
    monkeypatch.syspath_prepend(str(found.root))
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    for name in HPU_ENV:
        monkeypatch.delenv(name, raising=False)
    yield found
    forget()
