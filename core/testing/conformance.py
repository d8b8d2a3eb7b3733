"""The accelerator conformance suite: what every accelerator plugin, built-in or not, must pass.

Each check is a function ``check_<x>(accelerator) -> None`` that raises :class:`AssertionError`
with a message saying what is wrong. Run them:

* from pytest, by subclassing :class:`AcceleratorConformance` (one test per check)::

      class TestMine(AcceleratorConformance):
          accelerator_name = "mine"

* from code, with :func:`run_conformance` (a list of :class:`CheckResult`, never raises for a
  failing check), or from the shell with ``shardwise conformance mine``.

Everything runs on small tensors and takes seconds; the 2-rank communicator check launches two
processes once (their start-up dominates). The suite needs no pytest unless the base class is used
from pytest.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator

import torch

from ..accelerator import PLUGIN_API_VERSION, Accelerator, Availability
from ..errors import AcceleratorUnavailableError

# ----- shared helpers --------------------------------------------------------------------------

#: (atol, rtol) per dtype when a device result is compared with an fp32 CPU oracle. fp32 leaves
#: room for TF32-style matmuls; dtypes not listed use :data:`DEFAULT_TOLERANCE`.
DTYPE_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-3, 1e-3),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}
DEFAULT_TOLERANCE = (1e-1, 1e-1)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    return DTYPE_TOLERANCES.get(dtype, DEFAULT_TOLERANCE)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    """Reproducible fp32 CPU noise (the same numbers on every device)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _assert_close(actual: Any, expected: Any, dtype: torch.dtype, what: str) -> None:
    """Compare (nested tuples of) tensors on CPU in fp32 within ``dtype``'s tolerance."""
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected), (
            f"{what}: expected a sequence of {len(expected)} results, got {type(actual).__name__}")
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_close(a, e, dtype, f"{what}[{i}]")
        return
    assert isinstance(actual, torch.Tensor), (
        f"{what}: expected a tensor, got {type(actual).__name__}")
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    atol, rtol = _tolerance(dtype)
    try:
        torch.testing.assert_close(actual.detach().cpu().float(), expected.detach().cpu().float(),
                                   atol=atol, rtol=rtol)
    except AssertionError as exc:
        raise AssertionError(f"{what} differs beyond the {_dtype_name(dtype)} tolerance "
                             f"(atol={atol:g}, rtol={rtol:g}): {exc}") from None


@contextlib.contextmanager
def _env_without(name: str) -> Iterator[None]:
    """Temporarily remove environment variable ``name``."""
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


# ----- checks ----------------------------------------------------------------------------------

def check_metadata(accelerator: Accelerator) -> None:
    """Facts are set, the API version matches, dtypes are coherent, availability is explained."""
    cls = type(accelerator)
    for attr in ("name", "device_type", "communication_backend"):
        value = getattr(accelerator, attr)
        assert isinstance(value, str) and value, (
            f"{cls.__name__}.{attr} must be a non-empty string, got {value!r}")
    assert accelerator.plugin_api_version == PLUGIN_API_VERSION, (
        f"{cls.__name__}.plugin_api_version is {accelerator.plugin_api_version!r}; this shardwise "
        f"implements plugin API {PLUGIN_API_VERSION}")
    dtypes = accelerator.supported_dtypes
    assert dtypes and all(isinstance(d, torch.dtype) for d in dtypes), (
        f"{cls.__name__}.supported_dtypes must be a non-empty tuple of torch.dtype, "
        f"got {dtypes!r}")
    assert accelerator.preferred_dtype in dtypes, (
        f"preferred_dtype {accelerator.preferred_dtype} is not among supported_dtypes {dtypes}")
    backends = accelerator.ordered_kernel_backends()
    assert all(isinstance(b, str) and b for b in backends) and backends[-1] == "reference", (
        f"ordered_kernel_backends() must be backend names ending with 'reference', "
        f"got {backends!r}")
    status = cls.availability()
    assert isinstance(status, Availability), (
        f"{cls.__name__}.availability() must return shardwise.Availability, got {status!r}")
    assert status.ok or status.reason, (
        f"{cls.__name__}.availability() says unavailable without a reason; say what is missing")


def check_device_round_trip(accelerator: Accelerator) -> None:
    """A tensor copied to the device and back is unchanged; the device has the right type."""
    count = accelerator.device_count()
    assert count >= 1, f"device_count() is {count} on an available device"
    device = accelerator.device()
    assert device.type == accelerator.device_type, (
        f"device() returned {device}, expected type {accelerator.device_type!r}")
    x = _randn(4, 5)
    on_device = x.to(device)
    assert on_device.device.type == accelerator.device_type, f"tensor landed on {on_device.device}"
    back = on_device.cpu()
    assert torch.equal(back, x), "tensor changed on its way to the device and back"


def _small_affine(dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Inputs of ``x @ w + b`` in ``dtype`` on ``device``, and the fp32 CPU oracle result."""
    x, w, b = _randn(8, 32, seed=1), _randn(32, 16, seed=2) / 32 ** 0.5, _randn(16, seed=3)
    x, w, b = (t.to(dtype) for t in (x, w, b))
    expected = x.float() @ w.float() + b.float()  # the same (rounded) inputs, computed in fp32
    return x.to(device), w.to(device), b.to(device), expected


def check_dtypes_compute(accelerator: Accelerator) -> None:
    """Every claimed dtype really computes: a matmul + add on the device matches fp32 on CPU."""
    device = accelerator.device()
    for dtype in accelerator.supported_dtypes:
        try:
            x, w, b, expected = _small_affine(dtype, device)
            out = x @ w + b
        except Exception as exc:
            raise AssertionError(f"supported dtype {_dtype_name(dtype)} cannot compute on "
                                 f"{device}: {type(exc).__name__}: {exc}") from None
        assert out.dtype == dtype, f"{_dtype_name(dtype)} matmul returned {out.dtype}"
        _assert_close(out, expected, dtype, f"{_dtype_name(dtype)} matmul+add on {device}")


def check_memory(accelerator: Accelerator) -> None:
    """Memory queries answer: total > 0 and 0 <= free <= total, in bytes."""
    try:
        total, free = accelerator.total_memory(0), accelerator.free_memory(0)
    except NotImplementedError:
        raise AssertionError("total_memory()/free_memory() are not implemented; every "
                             "accelerator must report them (bytes)") from None
    assert isinstance(total, int) and isinstance(free, int), (
        f"memory must be reported as int bytes, got total={total!r}, free={free!r}")
    assert total > 0, f"total_memory(0) is {total}; expected a positive number of bytes"
    assert 0 <= free <= total, f"free_memory(0)={free} is not within [0, total_memory(0)={total}]"


def check_communicator(accelerator: Accelerator) -> None:
    """At world size 1 the communicator is local and every collective behaves as the identity."""
    import torch.distributed as dist

    from ..communicator import LocalCommunicator, create_communicator

    assert not (dist.is_available() and dist.is_initialized()), (
        "a torch.distributed process group is already initialised; run the conformance suite in a "
        "fresh single process")
    with _env_without("WORLD_SIZE"):
        comm = create_communicator(accelerator)
    try:
        assert isinstance(comm, LocalCommunicator), (
            f"world size 1 should give a LocalCommunicator, got {type(comm).__name__}")
        _check_local_collectives(comm, accelerator.device())
    finally:
        comm.close()


def _check_local_collectives(comm, device: torch.device) -> None:
    x = _randn(4, 3).to(device)
    for op in ("sum", "max", "min", "avg", "product"):
        reduced = comm.all_reduce(x.clone(), op=op)
        assert torch.equal(reduced.cpu(), x.cpu()), (
            f"all_reduce({op!r}) at world size 1 changed the tensor")
    gathered = comm.all_gather(x)
    assert torch.equal(gathered.cpu(), x.cpu()), (
        f"all_gather at world size 1 should return the tensor, got shape {tuple(gathered.shape)}")
    broadcast = comm.broadcast(x.clone(), src=0)
    assert torch.equal(broadcast.cpu(), x.cpu()), "broadcast from rank 0 changed the tensor"
    assert comm.barrier() is None, "barrier() should return None"
    exchanged = comm.all_to_all(x)
    assert torch.equal(exchanged.cpu(), x.cpu()), "all_to_all at world size 1 changed the tensor"


#: Seconds the 2-rank communicator check gives its two processes (start-up and set-up included)
#: before it fails as hung; each collective also times out after :data:`COLLECTIVE_TIMEOUT_S`.
TWO_RANK_DEADLINE_S = 180.0
COLLECTIVE_TIMEOUT_S = 60.0
#: Elements of the large all_reduce case (8 MiB of fp32): communicators choose their path by size
#: (the CPU's shared-memory all_reduce takes tensors up to a slot, gloo the rest).
LARGE_NUMEL = 1 << 21


class CheckSkipped(Exception):
    """A check that cannot run on this machine (e.g. fewer devices than ranks); it passes with
    the reason in its message."""


def check_communicator_2_ranks(accelerator: Accelerator) -> None:
    """The accelerator's own communicator on 2 ranks: two spawned processes (one launch for every
    case) set up from torchrun-style variables on the accelerator's communication backend, with
    collective timeouts. On each rank, ``all_reduce`` (every op; every supported dtype; a small
    and a large tensor), ``all_gather`` (dims 0 and 1), ``broadcast`` (from each rank),
    ``barrier`` and ``all_to_all`` must give the known results, and both ranks the same bytes.

    Skipped (passing, with the reason) where one node cannot host 2 ranks
    (``max_ranks_per_node() < 2``, e.g. one GPU). The accelerator is pickled into the processes:
    define its class at module level."""
    import multiprocessing as mp
    import pickle
    import socket

    if accelerator.max_ranks_per_node() < 2:
        raise CheckSkipped(f"one node hosts {accelerator.max_ranks_per_node()} rank(s) of "
                           f"{accelerator.name!r}; the 2-rank check needs 2")
    try:
        pickle.dumps(accelerator)
    except Exception as exc:
        raise AssertionError(f"the accelerator cannot be sent to the rank processes "
                             f"({type(exc).__name__}: {exc}); define its class at module "
                             f"level") from None
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")  # never fork a process that may hold a device context
    results = ctx.Queue()
    procs = [ctx.Process(target=_communicator_rank, args=(accelerator, rank, port, results),
                         daemon=True) for rank in range(2)]
    for proc in procs:
        proc.start()
    reports = _collect(results, procs, TWO_RANK_DEADLINE_S)
    problems = [f"rank {rank}: {p}" for rank, (problems, _) in sorted(reports.items())
                for p in problems]
    assert not problems, (f"the {accelerator.communicator_class().__name__} of "
                          f"{accelerator.name!r} on 2 ranks ({accelerator.communication_backend})"
                          f": " + "; ".join(problems))
    digests = [reports[rank][1] for rank in (0, 1)]
    differ = sorted(k for k, d in digests[0].items()
                    if d is not None and d != digests[1].get(k))
    assert not differ, f"the 2 ranks got different results from: {', '.join(differ)}"


def _collect(results, procs, deadline_s: float) -> dict[int, tuple[list[str], dict]]:
    """Each rank's (problems, result digests), waiting at most ``deadline_s`` in all; a rank
    that died or hung is a problem of its own (hung ranks are killed)."""
    import queue
    import time

    end, reports = time.monotonic() + deadline_s, {}
    while len(reports) < len(procs) and time.monotonic() < end:
        try:
            rank, problems, digests = results.get(timeout=0.5)
            reports[rank] = (problems, digests)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    for rank, proc in enumerate(procs):
        proc.join(timeout=max(0.0, end - time.monotonic()) if rank in reports else 0)
        hung = proc.is_alive()
        if hung:
            proc.kill()
            proc.join()
        if rank not in reports:
            why = (f"still running after {deadline_s:g}s (a collective or the set-up hung)"
                   if hung else f"died without a report (exit code {proc.exitcode})")
            reports[rank] = ([why], {})
    return reports


def _communicator_rank(accelerator: Accelerator, rank: int, port: int, results) -> None:
    """One rank of :func:`check_communicator_2_ranks`: puts ``(rank, problems, digests)``."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    problems, digests, comm = [], {}, None
    try:
        from ..communicator import create_communicator

        comm = create_communicator(accelerator, timeout_s=COLLECTIVE_TIMEOUT_S)
        expected = accelerator.communicator_class()
        if type(comm) is not expected:
            problems.append(f"create_communicator built a {type(comm).__name__}, not the "
                            f"accelerator's {expected.__name__}")
        if (comm.rank, comm.world_size) != (rank, 2):
            problems.append(f"communicator says rank {comm.rank} of {comm.world_size}, expected "
                            f"rank {rank} of 2")
        for what, check in _two_rank_cases(accelerator):
            try:
                digests[what] = check(comm, rank, accelerator.device())
            except AssertionError as exc:
                problems.append(f"{what}: {exc}")
            except Exception as exc:
                problems.append(f"{what} raised {type(exc).__name__}: {exc}")
    except Exception as exc:
        problems.append(f"setting up the communicator raised {type(exc).__name__}: {exc}")
    finally:
        if comm is not None:
            try:
                comm.close()
            except Exception as exc:
                problems.append(f"close() raised {type(exc).__name__}: {exc}")
    results.put((rank, problems, digests))


def _digest(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()


def _rank_input(rank: int, *shape: int, dtype=torch.float32) -> torch.Tensor:
    """Rank ``rank``'s input (CPU): reproducible, different on each rank, never zero."""
    return (_randn(*shape, seed=100 + rank) + 0.5).to(dtype)


def _expect_reduce(op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Oracle of a 2-rank all_reduce, in fp32 on CPU."""
    a, b = a.float(), b.float()
    return {"sum": a + b, "max": torch.maximum(a, b), "min": torch.minimum(a, b),
            "avg": (a + b) / 2, "product": a * b}[op]


def _all_reduce_case(op: str, dtype: torch.dtype, shape: tuple[int, ...]):
    def run(comm, rank: int, device: torch.device) -> str:
        x = _rank_input(rank, *shape, dtype=dtype).to(device)
        out = comm.all_reduce(x, op=op)
        want = _expect_reduce(op, _rank_input(0, *shape, dtype=dtype),
                              _rank_input(1, *shape, dtype=dtype))
        _assert_close(out, want, dtype, "the result")
        assert out.dtype == dtype, f"returned {out.dtype}"
        _assert_close(x, want, dtype, "the input tensor (all_reduce works in place)")
        return _digest(out)
    return run


def _all_gather_case(dim: int):
    def run(comm, rank: int, device: torch.device) -> str:
        out = comm.all_gather(_rank_input(rank, 2, 3).to(device), dim=dim)
        want = torch.cat([_rank_input(0, 2, 3), _rank_input(1, 2, 3)], dim=dim)
        assert out.shape == want.shape, f"shape {tuple(out.shape)}, expected {tuple(want.shape)}"
        assert torch.equal(out.cpu(), want), "not the ranks' tensors concatenated in rank order"
        return _digest(out)
    return run


def _broadcast_case(src: int):
    def run(comm, rank: int, device: torch.device) -> str:
        x = _rank_input(rank, 4, 3).to(device)
        out = comm.broadcast(x, src=src)
        want = _rank_input(src, 4, 3)
        assert torch.equal(out.cpu(), want), f"the result is not rank {src}'s tensor"
        assert torch.equal(x.cpu(), want), f"the input tensor does not hold rank {src}'s tensor " \
                                           f"(broadcast works in place)"
        return _digest(out)
    return run


def _barrier_case(comm, rank: int, device: torch.device) -> str:
    assert comm.barrier() is None, "barrier() should return None"
    return "none"


def _all_to_all_case(comm, rank: int, device: torch.device) -> None:
    out = comm.all_to_all(_rank_input(rank, 4, 3).to(device))
    # rank r receives chunk r (rows 2r, 2r + 1) of every rank, stacked in rank order
    want = torch.cat([_rank_input(src, 4, 3)[2 * rank:2 * rank + 2] for src in (0, 1)])
    assert out.shape == want.shape, f"shape {tuple(out.shape)}, expected {tuple(want.shape)}"
    assert torch.equal(out.cpu(), want), (f"rank {rank} should get chunk {rank} of each rank, "
                                          f"in rank order")
    return None  # each rank gets its own chunks


def _two_rank_cases(accelerator: Accelerator) -> list[tuple[str, Callable]]:
    """(name, run(comm, rank, device) -> digest of the result, the same on both ranks, or None
    where the ranks' results differ by design) for every 2-rank case."""
    cases = [(f"all_reduce({op!r}) float32", _all_reduce_case(op, torch.float32, (4, 3)))
             for op in ("sum", "max", "min", "avg", "product")]
    cases += [(f"all_reduce('sum') {_dtype_name(d)}", _all_reduce_case("sum", d, (4, 3)))
              for d in accelerator.supported_dtypes if d != torch.float32]
    cases.append((f"all_reduce('sum') float32 of {LARGE_NUMEL} elements",
                  _all_reduce_case("sum", torch.float32, (LARGE_NUMEL,))))
    cases += [(f"all_gather(dim={d})", _all_gather_case(d)) for d in (0, 1)]
    cases += [(f"broadcast(src={s})", _broadcast_case(s)) for s in (0, 1)]
    cases += [("barrier", _barrier_case), ("all_to_all", _all_to_all_case)]
    return cases


def _graph_example(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.tanh(a @ b + b.sum(0)) * 2.0 - a.mean()


def check_graph_strategy(accelerator: Accelerator) -> None:
    """A captured function, called with new inputs of the same shapes, equals eager execution."""
    strategy = accelerator.graph_strategy()
    device = accelerator.device()
    dtypes = accelerator.supported_dtypes
    dtype = torch.float32 if torch.float32 in dtypes else accelerator.preferred_dtype

    def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = _randn(4, 8, seed=seed), _randn(8, 8, seed=seed + 1)
        return a.to(device, dtype), b.to(device, dtype)

    captured = strategy.capture(_graph_example, *inputs(10))
    assert callable(captured), (
        f"{type(strategy).__name__}.capture returned {captured!r}, not a callable")
    for seed in (20, 30):  # two fresh input sets: a graph that ignores its inputs fails the second
        a, b = inputs(seed)
        expected = _graph_example(a, b)
        got = captured(a, b)
        got = got.clone() if isinstance(got, torch.Tensor) else got  # replay may reuse buffers
        _assert_close(got, expected, dtype,
                      f"graph strategy {strategy.name!r} result for new inputs (seed {seed})")


def check_launch_env(accelerator: Accelerator) -> None:
    """launch_env() returns str -> str for every local rank of 1- and 2-rank nodes."""
    for world in (1, 2):
        for rank in range(world):
            env = accelerator.launch_env(rank, world)
            assert isinstance(env, dict), (
                f"launch_env({rank}, {world}) returned {type(env).__name__}, not a dict")
            bad = {k: v for k, v in env.items()
                   if not (isinstance(k, str) and isinstance(v, str))}
            assert not bad, f"launch_env({rank}, {world}) has non-string entries: {bad!r}"


def _to_cpu(value: Any) -> Any:
    """A CPU copy (never the same tensor: in-place ops must not touch the device's inputs)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if not isinstance(value, (tuple, list, dict)) and callable(getattr(value, "to", None)):
        return value.to("cpu")  # e.g. a quantized weight: a bundle of tensors
    if isinstance(value, (tuple, list)):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def check_kernel_parity(accelerator: Accelerator) -> None:
    """Every op, resolved for this accelerator in every supported dtype, matches the reference
    on the op's example inputs (``shardwise.kernels.reference.examples()``), or the math its
    kernel declares where that differs (an example's ``expect``: e.g. a quantized linear that
    rounds activations to 8 bits, held to exactly that). An op that returns None works in place:
    its tensor arguments are compared instead."""
    from ..kernel_registry import REFERENCE, registry
    from ..kernels.reference import examples
    from ..kernels.reference.example import Example

    device, inputs = accelerator.device(), examples()
    for op in registry.ops():
        assert op in inputs, (f"kernel op {op!r} has no example inputs: add a builder to EXAMPLES "
                              f"in its shardwise.kernels.reference module")
        reference = registry.implementations(op)[REFERENCE]
        for dtype in accelerator.supported_dtypes:
            ex = Example.of(inputs[op](dtype, device))
            impl = registry.resolve(op, accelerator, dtype, **ex.resolve)
            what = f"{op} via backend {impl.backend!r} in {_dtype_name(dtype)}"
            args, kwargs = ex.args, ex.kwargs
            ref_args, ref_kwargs = _to_cpu(args), _to_cpu(kwargs)
            if ex.bind is not None:
                args, ref_args = ex.bind(impl, args), ex.bind(reference, ref_args)
            try:
                got = impl(*args, **kwargs)
            except Exception as exc:
                raise AssertionError(f"{what} raised {type(exc).__name__}: {exc}") from None
            expected = ex.expect(impl, args) if ex.expect is not None else None
            if expected is None:  # the reference's numbers (unless the kernel declares others)
                expected = reference(*ref_args, **ref_kwargs)
            if expected is None:  # in place: compare what each implementation wrote
                got, expected = _tensors(args), _tensors(ref_args)
            _assert_close(got, expected, dtype, what)


def _tensors(args: tuple) -> tuple[torch.Tensor, ...]:
    return tuple(a for a in args if isinstance(a, torch.Tensor))


#: Every check in the order it runs: check name -> function.
CHECKS: dict[str, Callable[[Accelerator], None]] = {
    "metadata": check_metadata,
    "device_round_trip": check_device_round_trip,
    "dtypes_compute": check_dtypes_compute,
    "memory": check_memory,
    "communicator": check_communicator,
    "communicator_2_ranks": check_communicator_2_ranks,
    "graph_strategy": check_graph_strategy,
    "launch_env": check_launch_env,
    "kernel_parity": check_kernel_parity,
}


# ----- running the suite -----------------------------------------------------------------------

@dataclass(frozen=True)
class CheckResult:
    """The outcome of one conformance check."""

    name: str
    passed: bool
    message: str = ""


def accelerator_under_test(accelerator: str | Accelerator | type[Accelerator] | None
                           ) -> Accelerator:
    """The instance the suite tests: ``accelerator`` may be a plugin name (``None`` detects), an
    instance or a class. Raises :class:`shardwise.PluginError` (or its subclass
    :class:`shardwise.AcceleratorUnavailableError`) when it is unknown, broken or cannot run
    here."""
    from ..plugins import get_accelerator

    if isinstance(accelerator, type) and issubclass(accelerator, Accelerator):
        accelerator = accelerator()
    if isinstance(accelerator, Accelerator):
        status = type(accelerator).availability()
        if not status:
            raise AcceleratorUnavailableError(
                f"accelerator {accelerator.name!r} is unavailable here: {status.reason}")
        return accelerator
    return get_accelerator(accelerator)


def run_check(name: str, accelerator: Accelerator) -> CheckResult:
    """Run one check by name; a failure (or crash) becomes a failed result, never an exception."""
    try:
        CHECKS[name](accelerator)
    except CheckSkipped as exc:
        return CheckResult(name, True, f"skipped: {exc}")
    except AssertionError as exc:
        return CheckResult(name, False, str(exc) or "assertion failed")
    except Exception as exc:  # a crashing check is a failing check
        return CheckResult(name, False, f"raised {type(exc).__name__}: {exc}")
    return CheckResult(name, True, "ok")


def run_conformance(accelerator: str | Accelerator | type[Accelerator] | None
                    ) -> list[CheckResult]:
    """Run every check against ``accelerator`` (a plugin name, an instance or a class; ``None``
    auto-detects) and return one :class:`CheckResult` per check, in :data:`CHECKS` order.

    Failing checks never raise. An accelerator that cannot be obtained at all (unknown, failed to
    load, or unavailable here) raises :class:`shardwise.PluginError` with the reason, since none
    of its checks can run.
    """
    instance = accelerator_under_test(accelerator)
    return [run_check(name, instance) for name in CHECKS]


# ----- pytest base class -----------------------------------------------------------------------

class AcceleratorConformance:
    """Pytest base class: subclass it as ``Test...`` and set :attr:`accelerator_name`.

    One ``test_<check>`` method per check. When the accelerator is installed but unavailable on
    this machine, every test skips with its reason (or fails, with :attr:`require_available`, for
    CI machines that do have the device); an unknown or broken plugin always fails. Set
    :attr:`accelerator_env` to environment variables the tests need (applied around each test,
    with plugins re-read so availability sees them). A subclass overriding ``setup_method`` or
    ``teardown_method`` must call ``super()``'s.
    """

    #: The plugin name to test (its entry-point name, what users pass as ``device=``).
    accelerator_name: ClassVar[str | None] = None
    #: Environment variables set while each test runs (e.g. to enable a device).
    accelerator_env: ClassVar[dict[str, str]] = {}
    #: Fail instead of skipping when the accelerator is unavailable here.
    require_available: ClassVar[bool] = False

    accelerator: Accelerator

    def setup_method(self, method=None) -> None:
        """Apply :attr:`accelerator_env` and load the accelerator (skip when unavailable)."""
        import pytest

        if not self.accelerator_name:
            pytest.fail(f"{type(self).__name__} must set accelerator_name to the plugin to test")
        self._saved_env = {k: os.environ.get(k) for k in self.accelerator_env}
        self._apply_env(self.accelerator_env)
        try:
            self.accelerator = accelerator_under_test(self.accelerator_name)
        except AcceleratorUnavailableError as exc:
            self.teardown_method(method)
            if self.require_available:
                pytest.fail(f"{exc} ({type(self).__name__}.require_available is set)")
            pytest.skip(str(exc))
        except Exception:
            self.teardown_method(method)
            raise

    def teardown_method(self, method=None) -> None:
        """Restore the environment changed by :meth:`setup_method`."""
        saved = getattr(self, "_saved_env", None)
        if saved:
            self._apply_env(saved)
        self._saved_env = {}

    @staticmethod
    def _apply_env(values: dict[str, str | None]) -> None:
        if not values:
            return
        from ..plugins import refresh_plugins

        for key, value in values.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        refresh_plugins()  # availability is cached per process; let it see the new environment

    def test_metadata(self) -> None:
        check_metadata(self.accelerator)

    def test_device_round_trip(self) -> None:
        check_device_round_trip(self.accelerator)

    def test_dtypes_compute(self) -> None:
        check_dtypes_compute(self.accelerator)

    def test_memory(self) -> None:
        check_memory(self.accelerator)

    def test_communicator(self) -> None:
        check_communicator(self.accelerator)

    def test_communicator_2_ranks(self) -> None:
        import pytest

        try:
            check_communicator_2_ranks(self.accelerator)
        except CheckSkipped as exc:
            pytest.skip(str(exc))

    def test_graph_strategy(self) -> None:
        check_graph_strategy(self.accelerator)

    def test_launch_env(self) -> None:
        check_launch_env(self.accelerator)

    def test_kernel_parity(self) -> None:
        check_kernel_parity(self.accelerator)
