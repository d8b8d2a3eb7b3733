"""Stand-in for ``habana_frameworks/torch/__init__.py`` (gaudi-pytorch-bridge): checks that the
running torch has the major/minor version the bridge was built for (``required_version.txt``,
an AssertionError otherwise), then imports core, distributed.hccl and hpu in the bridge's order.
The bridge's second check (stock torch refused in lazy mode) is left out: see README.md."""

import os

import torch
from packaging.version import Version

from habana_frameworks.torch.utils.internal import is_lazy  # noqa: F401  (as the bridge)

REQUIRED_VERSION_FILE = "required_version.txt"
REQUIRED_VERSION_FILE_PATH = os.path.join(os.path.dirname(__file__), REQUIRED_VERSION_FILE)

with open(REQUIRED_VERSION_FILE_PATH) as req_ver_file:
    compile_time_ver = Version(req_ver_file.read())

run_time_ver = Version(torch.__version__)
if not (run_time_ver.major == compile_time_ver.major
        and run_time_ver.minor == compile_time_ver.minor):
    raise AssertionError(f"Error: Compile-time major/minor PyTorch version {compile_time_ver} "
                         f"differs from run-time {run_time_ver}.")

import habana_frameworks.torch.core  # noqa: E402,F401
import habana_frameworks.torch.distributed.hccl  # noqa: E402,F401
import habana_frameworks.torch.hpu  # noqa: E402,F401
