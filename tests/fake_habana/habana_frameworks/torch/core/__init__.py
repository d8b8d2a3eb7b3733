"""Stand-in for ``habana_frameworks/torch/core/__init__.py``: ``mark_step`` (runs the ops
accumulated in lazy mode; the stand-in computes eagerly, so there is nothing to flush). Importing
it registers the ``hpu_backend`` dynamo backend, as the bridge's on-import wrapper does
(``dynamo/compile_backend/backends.py``)."""

import habana_frameworks.torch.dynamo.compile_backend.backends  # noqa: F401  registers hpu_backend


def mark_step(device_str="", sync=False):
    """Flush the lazy graph (a no-op here: the stand-in's ops already ran)."""
