"""Stand-in for ``habana_frameworks/torch/hpu/graphs.py``: ``HPUGraph`` (capture_begin /
capture_end / replay) and the ``graph`` context manager. ``hpu/__init__.py`` exports them only in
lazy mode (``if is_lazy(): from .graphs import *``), as the bridge does.

Capture records each aten op while running it; replay re-runs the recorded ops into the recorded
output tensors, so stale inputs give stale results, as on a device. A collective captured while
the process group is not the lazy-collectives one raises, as ``ProcessGroupHCCL.cpp`` asserts
(collectives inside an HPU graph need ``PT_HPU_ENABLE_LAZY_COLLECTIVES=true`` before hccl is
imported)."""

import habana_frameworks.torch as htorch
from torch.utils._python_dispatch import TorchDispatchMode


def _check_collective(func):
    if func.namespace != "c10d":
        return
    hccl = htorch.distributed.hccl
    if hccl._lazy_mode != 0 and not hccl._lazy_collectives_enabled:
        raise RuntimeError(
            f"ProcessGroupHCCL: collective {func} recorded in an HPU graph without lazy "
            f"collectives; set PT_HPU_ENABLE_LAZY_COLLECTIVES=true before importing "
            f"habana_frameworks")


class _Recorder(TorchDispatchMode):
    def __init__(self, ops):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        _check_collective(func)
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


class HPUGraph(object):
    def __init__(self):
        self._ops, self._mode = [], None

    def capture_begin(self):
        self._mode = _Recorder(self._ops)
        self._mode.__enter__()

    def capture_end(self):
        self._mode.__exit__(None, None, None)

    def replay(self):
        for func, args, kwargs, out in self._ops:
            fresh = func(*args, **kwargs)
            if isinstance(out, (tuple, list)):
                for o, f in zip(out, fresh):
                    if hasattr(o, "copy_"):
                        o.copy_(f)
            elif hasattr(out, "copy_"):
                out.copy_(fresh)


class graph(object):
    default_capture_stream = None

    def __init__(self, hpu_graph, stream=None):
        if self.__class__.default_capture_stream is None:
            self.__class__.default_capture_stream = htorch.hpu.Stream()
        self.capture_stream = stream if stream is not None else self.__class__.default_capture_stream
        self.stream_ctx = htorch.hpu.stream(self.capture_stream)
        self.hpu_graph = hpu_graph

    def __enter__(self):
        htorch.hpu.synchronize()
        self.stream_ctx.__enter__()
        self.hpu_graph.capture_begin()

    def __exit__(self, exc_type, exc_value, traceback):
        self.hpu_graph.capture_end()
        self.stream_ctx.__exit__(exc_type, exc_value, traceback)
