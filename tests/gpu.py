"""Helpers for the `gpu`-marked tests (skipped by conftest where no CUDA GPU exists)."""

import pytest

import shardwise


def cuda_accelerator(dtype):
    """The installed cuda accelerator; skips when this GPU cannot run ``dtype`` (bf16 before
    Ampere)."""
    accelerator = shardwise.get_accelerator("cuda")
    if dtype not in accelerator.supported_dtypes:
        pytest.skip(f"this GPU does not run {dtype}")
    return accelerator
