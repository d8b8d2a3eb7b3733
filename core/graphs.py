"""Device-neutral pieces of graph capture: static input buffers, a replayable callable, the
per-user folder where compiled artifacts are kept, and the progress line shown while capturing.

A device's :class:`~shardwise.GraphStrategy` captures with its own runtime (CUDA graphs, HPU
graphs) and wraps the result in :class:`StaticGraph`, so every strategy has the same contract.
"""

from __future__ import annotations

import builtins
import logging
import os
import sys
import threading
import time
import types
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from .accelerator import dtype_name
from .errors import ConfigError

log = logging.getLogger(__name__)

#: Environment variable naming the folder where shardwise keeps compiled artifacts (default
#: ``$XDG_CACHE_HOME/shardwise``, else ``~/.cache/shardwise``): see :func:`cache_dir`.
CACHE_DIR_ENV = "SHARDWISE_CACHE_DIR"


def cache_root() -> Path:
    """The per-user folder of shardwise's compiled artifacts (not created here):
    ``$SHARDWISE_CACHE_DIR``, else ``$XDG_CACHE_HOME/shardwise``, else ``~/.cache/shardwise``.
    Never a shared temporary folder: another user could plant code there that this process
    would load."""
    chosen = os.environ.get(CACHE_DIR_ENV, "").strip()
    if chosen:
        return Path(chosen).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg and os.path.isabs(os.path.expanduser(xdg)) else (
        Path.home() / ".cache")
    return (base / "shardwise").resolve()


def cache_dir(*parts: str) -> Path:
    """``cache_root() / parts``, created (private to the user: mode 0700) if missing. A folder
    that cannot be created or written is a :class:`~shardwise.errors.ConfigError` naming
    :data:`CACHE_DIR_ENV`."""
    path = cache_root().joinpath(*parts)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the shardwise cache folder {str(path)!r} "
                          f"({exc.strerror or exc}); set {CACHE_DIR_ENV} to a writable folder"
                          ) from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"the shardwise cache folder {str(path)!r} is not writable; set "
                          f"{CACHE_DIR_ENV} to a writable folder")
    return path


@contextmanager
def progress(what: str, stream=None, interval: float = 0.5) -> Iterator[None]:
    """Show that ``what`` (e.g. "compiling the decode step for batch bucket 4") is under way:
    on a terminal, one line on stderr rewritten in place with the seconds elapsed and ended
    with the total; elsewhere (logs, CI), an INFO log line at the start and one at the end."""
    stream = sys.stderr if stream is None else stream
    start = time.perf_counter()
    tty = bool(getattr(stream, "isatty", lambda: False)())
    if not tty:
        log.info("shardwise: %s ...", what)
        try:
            yield
        finally:
            log.info("shardwise: %s: %.1f s", what, time.perf_counter() - start)
        return
    done = threading.Event()

    def tick() -> None:
        while not done.wait(interval):
            stream.write(f"\rshardwise: {what} ... {time.perf_counter() - start:.0f} s")
            stream.flush()

    ticker = threading.Thread(target=tick, name="shardwise-progress", daemon=True)
    stream.write(f"shardwise: {what} ...")
    stream.flush()
    ticker.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        done.set()
        ticker.join()
        end = "done" if ok else "failed"
        stream.write(f"\rshardwise: {what}: {end} in {time.perf_counter() - start:.1f} s\x1b[K\n")
        stream.flush()


def _shapes(tensors: Sequence[torch.Tensor]) -> str:
    return ", ".join(str(tuple(t.shape)) for t in tensors)


def fresh_code(fn: Callable) -> Callable:
    """``fn`` behind a wrapper with its own code object and its own globals, for a graph
    strategy that captures with ``torch.compile``: dynamo keeps compiled code and its recompile
    count per code object, and installs the compiled graph (``__compiled_fn_*``) in the globals
    of the frame it compiles, so this gives each capture its own of each, freed with the
    wrapper instead of living in the strategy's module for good."""

    def call(*args):
        return fn(*args)

    scope = {"__builtins__": builtins, "__name__": f"{__name__}.<capture>"}
    return types.FunctionType(call.__code__.replace(), scope, call.__name__, None,
                              call.__closure__)


def static_copies(example_args: Sequence[Any], device_type: str) -> tuple[torch.Tensor, ...]:
    """Static input buffers for a graph: clones of the examples, which must be on the device."""
    for i, arg in enumerate(example_args):
        if not isinstance(arg, torch.Tensor):
            raise TypeError(f"graph capture takes tensors only; argument {i} is "
                            f"{type(arg).__name__}: pass it as a tensor or bind it into fn")
        if arg.device.type != device_type:
            raise ValueError(
                f"graph capture argument {i} is on {arg.device}, not on a {device_type} device: "
                f"ops on other devices are not captured and would silently go stale on replay; "
                f"move the example arguments to {device_type} first")
    with torch.inference_mode(False):  # normal tensors: replays may run outside inference mode
        return tuple(arg.detach().clone() for arg in example_args)


def static_outputs(outputs: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Check a captured function's result: a tensor or a tuple/list of tensors (lists → tuple)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, (tuple, list)) and all(isinstance(o, torch.Tensor) for o in outputs):
        return tuple(outputs)
    raise TypeError(f"graph capture needs fn to return a tensor or a tuple of tensors, got "
                    f"{type(outputs).__name__}; wrap fn so it returns only tensors")


class StaticGraph:
    """A captured graph as a callable with the captured function's signature.

    Each call copies the arguments into the static input buffers the graph was captured with,
    replays it, and returns the static outputs. **The returned tensors are the same objects on
    every call and are overwritten by the next replay**: ``.clone()`` them to keep a result.
    Arguments must have the captured shapes and dtypes (capture one graph per shape).
    """

    def __init__(self, replay: Callable[[], None], inputs: tuple[torch.Tensor, ...],
                 outputs: torch.Tensor | tuple[torch.Tensor, ...], graph: Any = None) -> None:
        self._replay = replay
        self.static_inputs = inputs
        self.static_outputs = outputs
        self.graph = graph  # kept alive as long as the callable: it owns the captured memory

    def __reduce__(self):
        # a captured graph is process-local (compiled code, static buffers): it pickles as a
        # placeholder that says so. (torch's saved guard state of a precompiled step pickles
        # what the step's modules reach, and an instance-level forward may reach a graph.)
        return _ProcessLocalGraph, ()

    def __call__(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        self._check(args)
        for static, arg in zip(self.static_inputs, args):
            if arg is not static:
                static.copy_(arg)
        self._replay()
        return self.static_outputs

    def _check(self, args: tuple[Any, ...]) -> None:
        if len(args) != len(self.static_inputs):
            raise TypeError(f"the graph was captured with {len(self.static_inputs)} arguments, "
                            f"called with {len(args)}")
        for i, (static, arg) in enumerate(zip(self.static_inputs, args)):
            if not isinstance(arg, torch.Tensor):
                raise TypeError(f"graph argument {i} must be a tensor, got {type(arg).__name__}")
            if arg.shape != static.shape or arg.dtype != static.dtype:
                raise ValueError(
                    f"graph argument {i}: expected shape {tuple(static.shape)} "
                    f"{dtype_name(static.dtype)} (as captured), got shape {tuple(arg.shape)} "
                    f"{dtype_name(arg.dtype)}; all captured shapes: {_shapes(self.static_inputs)}."
                    f" Capture one graph per shape (e.g. per batch size) or pad the input")


class _ProcessLocalGraph:
    """What an unpickled :class:`StaticGraph` is: a captured graph does not leave its process."""

    def __call__(self, *args: Any) -> None:
        raise RuntimeError("a captured graph does not survive pickling: capture it again in "
                           "this process")
