"""``shardwise serve``'s process: options checked → model loaded → engine → :class:`SlotRunner`
(warmed up: every batch bucket captured before the first request) → :class:`Scheduler` →
FastAPI app → uvicorn, on one process or, with ``--tp N``, on N ranks started through
``shardwise launch`` (rank 0 serves HTTP and runs the scheduler; the others follow its steps).

Shutdown: SIGTERM / SIGINT stop accepting connections, let running sequences finish for
``--drain-timeout`` seconds, cancel the rest (their streams end) and exit 0; a second signal
stops at once. A watchdog checks ``backend.healthy()`` on every tick of uvicorn's loop: when the
model side has failed (a tensor-parallel rank died, so a collective timed out) the server says
why on stderr and exits 1 — within the collective timeout and a few seconds, never a hang.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from .. import models
from ..errors import ConfigError
from .scheduler import DEFAULT_PREFILL_STALL

#: The module each ``--tp`` rank runs (through ``shardwise launch``).
RANK_MODULE = "shardwise.serve.rank_main"
#: Tokenizer files one of which a model directory needs (the API speaks text).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt")
#: ``--max-tokens`` default: the model's context, capped here so ``--max-batch`` KV slots stay
#: small (SmolLM2-135M in bf16: 16 slots × 2048 tokens × 30 layers × K,V × 3 heads × 64 × 2 B
#: ≈ 0.75 GB).
DEFAULT_MAX_TOKENS_CAP = 2048
#: Seconds a failed server gives open streams to receive their error before it exits anyway.
FAILED_EXIT_GRACE_S = 2.0
#: Seconds after the drain timeout the ``--tp`` parent waits for rank 0 before it stops the
#: launcher (and as much again before it kills the ranks).
TP_STOP_GRACE_S = 15.0


@dataclass
class ServeSettings:
    """``shardwise serve``'s options after every cheap check and the device's defaults.

    ``max_tokens`` is None only for a GGUF file (its context is known once loaded)."""

    model_path: Path
    name: str
    encoder: bool
    device: str
    dtype: str
    inject: bool
    graphs: bool
    quant: str | None
    tp: int
    host: str
    port: int
    max_batch: int
    max_tokens: int | None
    positions: int | None
    max_waiting: int
    prefill_budget: int
    comm_timeout: float | None
    drain_timeout: float
    pp: int = 1
    micro_batches: int = 1
    #: ``--weight-dtype``: 16-bit linear weights under the fp32 compute dtype (None: the dtype's)
    weight_dtype: str | None = None
    #: ``--prefill-stall``: the scheduler's ``prefill_stall``
    prefill_stall: float = DEFAULT_PREFILL_STALL

    @property
    def ranks(self) -> int:
        """Ranks the server runs on: ``pp × tp``."""
        return self.pp * self.tp

    def engine_options(self, max_tokens: int) -> dict[str, Any]:
        """``init_inference`` keywords for these settings."""
        from ..bench.plan import engine_options

        options = {"device": self.device, "dtype": self.dtype, "max_tokens": max_tokens,
                   **engine_options(self.inject, self.graphs, self.quant)}
        if self.weight_dtype:
            options["weight_dtype"] = self.weight_dtype
        if self.tp > 1:
            options["tensor_parallel"] = {"tp_size": self.tp}
        if self.pp > 1:
            options["pipeline_parallel"] = {"pp_size": self.pp,
                                            **({"micro_batches": self.micro_batches}
                                               if self.micro_batches > 1 else {})}
        if self.comm_timeout is not None:
            options["comm_timeout"] = self.comm_timeout
        return options

    def describe(self) -> str:
        """``cpu, bfloat16, inject, graphs, no quant, tp=1`` for the ready line."""
        return ", ".join([self.device, self.dtype, "inject" if self.inject else "no inject",
                          "graphs" if self.graphs else "no graphs",
                          f"quant {self.quant}" if self.quant else "no quant",
                          *([f"{self.weight_dtype} weights"] if self.weight_dtype else []),
                          f"tp={self.tp}",
                          *([f"pp={self.pp}" + (f" x {self.micro_batches} micro-batches"
                                                 if self.micro_batches > 1 else "")]
                            if self.pp > 1 else [])])


# ----- cheap checks, before anything loads -----------------------------------------------------

def _at_least(value: int | float | None, low: int, flag: str, why: str = "") -> None:
    if value is not None and value < low:
        raise ConfigError(f"{flag} must be at least {low}{why}, got {value}")


def check_server_options(args: argparse.Namespace) -> None:
    """Ranges of the options that need no device or model."""
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be a TCP port from 0 to 65535 (0: a free one), got "
                          f"{args.port}")
    _at_least(args.max_batch, 1, "--max-batch", " (KV-cache slots)")
    _at_least(args.max_tokens, 2, "--max-tokens", " (a prompt token and a completion token)")
    _at_least(args.max_waiting, 1, "--max-waiting")
    _at_least(args.prefill_budget, 1, "--prefill-budget", " token")
    if not (math.isfinite(args.prefill_stall) and args.prefill_stall > 0):
        raise ConfigError(f"--prefill-stall must be a finite number > 0 (a fraction of a decode "
                          f"step; {DEFAULT_PREFILL_STALL:g} by default), got {args.prefill_stall}")
    _at_least(args.tp, 1, "--tp")
    _at_least(args.pp, 1, "--pp")
    _at_least(args.micro_batches, 1, "--micro-batches")
    if args.micro_batches is not None and args.pp == 1:
        raise ConfigError("--micro-batches splits a decode step between pipeline stages: it "
                          "needs --pp > 1 (or drop it)")
    if args.comm_timeout is not None and not (math.isfinite(args.comm_timeout)
                                              and args.comm_timeout > 0):
        raise ConfigError(f"--comm-timeout must be a finite number of seconds > 0, got "
                          f"{args.comm_timeout}")
    if not (math.isfinite(args.drain_timeout) and args.drain_timeout >= 0):
        raise ConfigError(f"--drain-timeout must be a finite number of seconds >= 0, got "
                          f"{args.drain_timeout}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ConfigError("--served-model-name is empty; pass the name clients use as 'model'")
    if args.graphs and args.inject is False:
        raise ConfigError("--graphs captures the injected decode step: drop --no-inject (or "
                          "--graphs)")


def is_encoder(config: dict[str, Any]) -> bool:
    """Whether a config.json describes an encoder-only model (BERT-like: served for embeddings,
    without generation endpoints); encoder-decoder models are refused."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if config.get("is_encoder_decoder"):
        raise ConfigError(f"model_type {config.get('model_type')!r} is an encoder-decoder model; "
                          f"`shardwise serve` serves decoder-only models (generation) and "
                          f"encoder-only models (embeddings)")
    return (config.get("model_type") in MODEL_FOR_MASKED_LM_MAPPING_NAMES
            and not config.get("is_decoder"))


def _check_tokenizer(path: Path) -> None:
    if path.is_dir() and not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"model directory {str(path)!r} has no tokenizer (none of "
                          f"{', '.join(TOKENIZER_FILES)}); the server speaks text: save one next "
                          f"to the model with tokenizer.save_pretrained(DIR)")


def _check_ranks(accelerator, tp: int, pp: int = 1) -> None:
    """``--tp`` × ``--pp`` ranks run on this node: at most what the accelerator hosts on
    one."""
    limit = accelerator.max_ranks_per_node()
    if tp * pp > limit:
        asked = f"--tp {tp}" if pp == 1 else f"--tp {tp} x --pp {pp}"
        raise ConfigError(f"{asked} needs {tp * pp} ranks but {accelerator.name!r} hosts at "
                          f"most {limit} on this node; ask for {limit} ranks or fewer")


def _engine_variant(args: argparse.Namespace, accelerator, encoder: bool) -> tuple[bool, bool]:
    """(inject, graphs): as asked, else the fastest the device supports — injection (the slot
    KV cache continuous batching runs on), graphs where the device's strategy accelerates."""
    inject = True if args.inject is None else args.inject
    if not inject and not encoder:
        raise ConfigError("--no-inject: continuous batching runs on the injected layers' slot KV "
                          "cache (replace_with_kernel_inject); drop --no-inject")
    if encoder:  # an encoder has no decode step to capture
        if args.graphs:
            raise ConfigError("--graphs captures a decode step, and an encoder model has none; "
                              "drop --graphs")
        return inject, False
    graphs = args.graphs if args.graphs is not None else accelerator.graph_strategy().accelerates
    return inject, graphs


def _max_tokens(asked: int | None, positions: int | None) -> int | None:
    """The KV-cache positions per sequence: ``--max-tokens`` (refused beyond the model's
    context), else the context capped at DEFAULT_MAX_TOKENS_CAP; None while the context is
    unknown (a GGUF file before loading)."""
    if asked is not None:
        if positions is not None and asked > positions:
            raise ConfigError(f"--max-tokens {asked} is more than the model's context of "
                              f"{positions} positions (max_position_embeddings); pass "
                              f"--max-tokens {positions} or less")
        return asked
    if positions is None:
        return None
    return min(positions, DEFAULT_MAX_TOKENS_CAP)


def resolve_settings(args: argparse.Namespace) -> ServeSettings:
    """Check every option (no model is loaded, no port bound) and fill in the device's
    defaults; a :class:`ConfigError` names what is wrong."""
    from ..bench.plan import resolve_dtype_name
    from ..plugins import get_accelerator

    check_server_options(args)
    path = models.check_model_path(args.model) if args.model else models.default_model_path()
    _check_tokenizer(path)
    config = models.read_config(path) if path.is_dir() else {}
    encoder = is_encoder(config)
    accelerator = get_accelerator(args.device)
    if args.tp * args.pp > 1:
        _check_ranks(accelerator, args.tp, args.pp)
        if encoder:
            raise ConfigError("--tp / --pp with an encoder model: embeddings are served on one "
                              "rank; drop them")
    dtype = resolve_dtype_name(accelerator, args.dtype or "auto")
    inject, graphs = _engine_variant(args, accelerator, encoder)
    positions = models.max_positions(config) if config else None
    name = args.served_model_name or (models.DEFAULT_MODEL_NAME if args.model is None
                                      else path.stem if path.suffix == ".gguf"
                                      else path.resolve().name)
    return ServeSettings(
        model_path=path, name=name, encoder=encoder, device=accelerator.name, dtype=dtype,
        inject=inject, graphs=graphs, quant=args.quant, tp=args.tp, host=args.host,
        port=args.port, max_batch=args.max_batch,
        max_tokens=_max_tokens(args.max_tokens, positions), positions=positions,
        max_waiting=args.max_waiting, prefill_budget=args.prefill_budget,
        prefill_stall=args.prefill_stall, comm_timeout=args.comm_timeout,
        drain_timeout=args.drain_timeout, pp=args.pp,
        micro_batches=args.micro_batches or 1, weight_dtype=_weight_dtype(args, dtype, graphs))


def _weight_dtype(args: argparse.Namespace, dtype: str, graphs: bool) -> str | None:
    """``--weight-dtype`` checked against the resolved dtype, graphs and quantization (the
    engine's own refusals, given here by the options' names before anything loads)."""
    wd = getattr(args, "weight_dtype", None)
    if wd is None:
        return None
    if dtype != "float32":
        raise ConfigError(f"--weight-dtype {wd} keeps {wd} weights under fp32 activations; the "
                          f"compute dtype is {dtype}: add --dtype fp32")
    if args.quant:
        raise ConfigError(f"--weight-dtype {wd} with --quant {args.quant}: quantization already "
                          f"sets the weights' format; give one of them")
    if not graphs:
        raise ConfigError(f"--weight-dtype {wd} is kept by the decode graphs' weight layout; "
                          f"drop --no-graphs (or --weight-dtype)")
    return wd


class ServerThread:
    """uvicorn serving ``app`` on ``127.0.0.1`` at a free port from a daemon thread, in this
    process (the tests' servers, the load benchmark's): the socket listens from construction,
    so requests sent before uvicorn has started wait in its backlog."""

    def __init__(self, app: Any, graceful_s: float = 2.0, join_s: float = 15.0) -> None:
        import uvicorn

        self.sock = bind_socket("127.0.0.1", 0)
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                    access_log=False,
                                                    timeout_graceful_shutdown=graceful_s))
        self.join_s = join_s
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerThread":
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop uvicorn (its graceful shutdown bounded by ``graceful_s``) and close the socket;
        a thread still alive after ``join_s`` is an error."""
        self.server.should_exit = True
        self.thread.join(self.join_s)
        self.sock.close()
        if self.thread.is_alive():
            raise RuntimeError(f"uvicorn on port {self.port} did not stop within {self.join_s} s")


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening), so a taken port or a bad address
    fails before the model loads; uvicorn listens on it once the server is ready."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r} is not an address of this machine ({exc.strerror})") \
            from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        hint = "pass another --port (0 picks a free one)" if exc.errno == 98 else \
            "pass --host with an address of this machine"
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}; {hint}") from None
    return sock


# ----- the stack: engine → runner → scheduler → app state --------------------------------------

class Stack(NamedTuple):
    """What :func:`build_stack` builds (runner and scheduler are None for an encoder)."""

    engine: Any
    runner: Any
    scheduler: Any
    state: Any


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """The ids that end a sequence: the generation config's ``eos_token_id`` (an int or a list)
    and the tokenizer's, deduplicated."""
    ids: list[int] = []
    config = getattr(model, "generation_config", None)
    for value in (getattr(config, "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)):
        if value is None:
            continue
        ids += [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    return tuple(dict.fromkeys(ids))


def heartbeat_seconds(comm_timeout: float | None) -> float:
    """How often an idle rank 0 tells the others it is alive: well inside the collective
    timeout, at most every 5 s."""
    from ..communicator import resolve_timeout

    return min(5.0, resolve_timeout(comm_timeout) / 4)


def build_stack(model, tokenizer, *, max_batch: int = 16, max_tokens: int = 256,
                name: str = "model", max_waiting: int = 64, prefill_budget: int = 512,
                heartbeat_s: float = 5.0, start: bool = True, progress=None,
                prefill_stall: float | None = DEFAULT_PREFILL_STALL, prefill_worth: bool = True,
                mixed: bool = True, **engine_kwargs: Any) -> Stack:
    """Build the server's layers over ``model``: ``init_inference(model, max_tokens=...,
    **engine_kwargs)`` (a causal LM needs ``replace_with_kernel_inject=True``), a warmed-up
    ``SlotRunner(engine, max_batch, max_tokens)``, a ``Scheduler`` with the model's
    end-of-sequence ids and ``ServeMetrics`` (started unless ``start=False``), and the API's
    ``ServeState``. An encoder model (BERT-like) gets an ``Embedder`` and no runner or scheduler.
    ``progress(text)``, when given, is told what the slow steps are doing. ``prefill_budget``,
    ``prefill_stall``, ``prefill_worth`` and ``mixed`` (prompt chunks inside the decode step)
    are the scheduler's
    (:class:`~shardwise.serve.scheduler.Scheduler`).

    Returns a :class:`Stack` ``(engine, runner, scheduler, state)``; pass ``state`` to
    ``shardwise.serve.api.build_app``. Stop with ``scheduler.stop(drain_s)``."""
    from ..engine import init_inference
    from .api import ServeState
    from .metrics import ServeMetrics

    metrics = ServeMetrics()
    if is_encoder(model.config.to_dict()):  # no KV cache: max_tokens only bounds the inputs
        from .embeddings import Embedder

        engine = init_inference(model, **engine_kwargs)
        state = ServeState(None, tokenizer, name, max_tokens, metrics,
                           embedder=Embedder(engine, tokenizer,
                                             release_threads=engine.accelerator.release_thread_pool))
        return Stack(engine, None, None, state)
    engine = init_inference(model, max_tokens=max_tokens, **engine_kwargs)
    from .runner import SlotRunner
    from .scheduler import Scheduler

    runner = SlotRunner(engine, max_batch, max_tokens)
    if progress is not None:
        graphs = "capturing" if engine.config.enable_graph else "running"
        progress(f"{graphs} the decode step of batch buckets {runner.buckets()} (once, before "
                 f"serving)")
    runner.warmup()
    scheduler = Scheduler(runner, eos_token_ids=eos_token_ids(model, tokenizer),
                          max_waiting=max_waiting, prefill_budget=prefill_budget,
                          prefill_stall=prefill_stall, prefill_worth=prefill_worth,
                          mixed=mixed, metrics=metrics, heartbeat_s=heartbeat_s,
                          release_threads=engine.accelerator.release_thread_pool)
    if start:
        scheduler.start()
    state = ServeState(scheduler, tokenizer, name, runner.max_tokens, metrics)
    return Stack(engine, runner, scheduler, state)


def load(settings: ServeSettings):
    """``(model, tokenizer, max_tokens)``: the model loaded in the settings' dtype (a causal
    LM through :func:`shardwise.models.load_model`, an encoder as ``AutoModel``), its
    tokenizer, and the KV-cache positions per sequence (now known for GGUF files too)."""
    import torch

    dtype = getattr(torch, settings.dtype)
    if settings.encoder:
        from transformers import AutoModel, AutoTokenizer

        model = AutoModel.from_pretrained(settings.model_path, dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(settings.model_path)
    else:
        model, tokenizer = models.load_model(settings.model_path, dtype=dtype)
    if tokenizer is None:
        raise ConfigError(f"{settings.model_path} has no tokenizer; save one next to the model "
                          f"with tokenizer.save_pretrained(DIR)")
    max_tokens = settings.max_tokens
    if max_tokens is None:  # a GGUF file: its context is known now
        max_tokens = _max_tokens(None, models.max_positions(model.config)) \
            or DEFAULT_MAX_TOKENS_CAP
    return model, tokenizer, max_tokens


def build_from_settings(settings: ServeSettings) -> Stack:
    """Load the model and build the stack as the settings say (saying so on stderr)."""
    def progress(text: str) -> None:
        print(f"shardwise serve: {text}", file=sys.stderr, flush=True)

    progress(f"loading {settings.model_path} ({settings.describe()})")
    model, tokenizer, max_tokens = load(settings)
    return build_stack(
        model, tokenizer, max_batch=settings.max_batch, max_tokens=max_tokens,
        name=settings.name, max_waiting=settings.max_waiting,
        prefill_budget=settings.prefill_budget, prefill_stall=settings.prefill_stall,
        heartbeat_s=heartbeat_seconds(settings.comm_timeout), progress=progress,
        **{k: v for k, v in settings.engine_options(max_tokens).items() if k != "max_tokens"})


def freeze_startup_objects() -> int:
    """Collect garbage once, then move every object alive after start-up — the model, its
    compiled steps, the tokenizer, the libraries: ~500 000 objects for the default model —
    out of the garbage collector's generations (``gc.freeze``); returns how many.

    A full (oldest-generation) collection walks every tracked object while holding the GIL:
    ~285 ms of CPU for the default model's server process (measured under load; a fraction of
    that on a quiet CPU, still several decode steps), during which the scheduler's thread
    cannot start the next step, so each one is an inter-token gap several times the median
    for every running stream. Frozen objects are never walked again (nor collected: what the
    start-up leaves behind lives as long as the server, as it would anyway). Process-wide, so
    the server's entry point calls it, not :func:`build_stack`."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


# ----- HTTP: uvicorn with a graceful stop and a health watchdog ----------------------------------

def _uvicorn_server_class():
    import uvicorn

    class ShardwiseServer(uvicorn.Server):
        """uvicorn's server, which on a signal also drains the backend (in a thread, so the
        event loop goes on streaming), exits 0 instead of re-raising the signal, and on every
        tick of its loop checks the backend's health (the watchdog)."""

        def __init__(self, config, backend, drain_s: float, ready_line: str) -> None:
            super().__init__(config)
            self.backend = backend
            self.drain_s = drain_s
            self.ready_line = ready_line
            self.exit_code = 0
            self.drainer: threading.Thread | None = None

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                print(self.ready_line, flush=True)

        def handle_exit(self, sig: int, frame) -> None:  # not recorded: no re-raise at exit
            if self.should_exit:
                self.force_exit = True  # a second signal: stop waiting for the streams
                return
            self.should_exit = True
            print(f"shardwise serve: {signal.Signals(sig).name}: no new connections; running "
                  f"requests may finish for {self.drain_s:g} s", file=sys.stderr, flush=True)
            self.start_drain()

        def start_drain(self) -> None:
            if self.backend is not None and self.drainer is None:
                self.drainer = threading.Thread(target=self.backend.stop, args=(self.drain_s,),
                                                name="shardwise-drain", daemon=True)
                self.drainer.start()

        async def on_tick(self, counter: int) -> bool:
            if self.exit_code == 0 and self.drainer is None and self.backend is not None \
                    and not self.backend.healthy():
                self.fail("the model side failed (a tensor-parallel rank died or a collective "
                          "timed out; its error is logged above)")
                return True
            return await super().on_tick(counter)

        def fail(self, why: str) -> None:
            """Log ``why``, end the open streams' connections, and make sure the process exits
            with code 1 shortly even if a thread of the failed model side never returns."""
            print(f"shardwise serve: unhealthy: {why}; exiting", file=sys.stderr, flush=True)
            self.exit_code = 1
            self.should_exit = self.force_exit = True
            _exit_later(1, FAILED_EXIT_GRACE_S)

    return ShardwiseServer


def _exit_later(code: int, delay_s: float) -> None:
    """End the process with ``code`` after ``delay_s`` seconds whatever else still runs."""
    def _exit() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(delay_s, _exit)
    timer.daemon = True
    timer.start()


def run_http(stack: Stack, sock: socket.socket, settings: ServeSettings) -> int:
    """Serve ``stack`` on the bound ``sock`` until a signal or a failure; the exit code."""
    import uvicorn

    from .api import build_app

    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    ready = f"serving {settings.name} on http://{shown}:{port} ({settings.describe()})"
    config = uvicorn.Config(build_app(stack.state), log_level="info", access_log=False,
                            timeout_graceful_shutdown=settings.drain_timeout + 5)
    backend = stack.scheduler
    server = _uvicorn_server_class()(config, backend, settings.drain_timeout, ready)
    server.run(sockets=[sock])
    if server.exit_code:
        return server.exit_code
    server.start_drain()  # uvicorn stopped on its own (no signal): drain too
    if server.drainer is not None:
        server.drainer.join(settings.drain_timeout + 10)
        if server.drainer.is_alive() or not backend.healthy():
            server.fail("the model side failed while draining")
            return 1
    return 0


# ----- one process, the ranks of --tp, and the --tp parent ---------------------------------------

def serve(args: argparse.Namespace) -> int:
    """``shardwise serve``: check the options, then serve on this process, or with ``--tp N``
    and/or ``--pp P`` launch the ranks (each runs :func:`run_rank`) and wait for them; the exit
    code."""
    settings = resolve_settings(args)
    if settings.ranks > 1:
        return serve_tp(settings)
    return serve_here(settings)


def run_rank(args: argparse.Namespace) -> int:
    """One rank of ``--tp N`` / ``--pp P`` (under ``shardwise launch``): rank 0 serves HTTP and
    runs the scheduler, whose runner sends each step to the others; the others execute those
    steps (:func:`shardwise.serve.runner.follow`) until rank 0 closes, and fail with a
    CollectiveError within the collective timeout when rank 0 dies."""
    settings = resolve_settings(args)
    try:
        if int(os.environ.get("RANK", "0")) == 0:
            return serve_here(settings)
        from ..engine import init_inference
        from .runner import follow

        model, _, max_tokens = load(settings)
        follow(init_inference(model, **settings.engine_options(max_tokens)))
        return 0
    finally:
        _leave_group()


def _leave_group() -> None:
    """Destroy this rank's process group before the interpreter exits: left to the exit, the
    group's threads can be torn down mid-flight and abort the process (a clean stop would then
    exit non-zero). Local to this rank: no collective, nothing to wait for."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _StoppedBeforeServing(Exception):
    """A stop signal arrived while the model was loading or warming up."""


@contextlib.contextmanager
def _stop_on_signal() -> Iterator[None]:
    """While loading and warming up, SIGTERM / SIGINT stop at once (nothing to drain yet)."""
    def stop(sig: int, frame) -> None:
        raise _StoppedBeforeServing(signal.Signals(sig).name)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve_here(settings: ServeSettings) -> int:
    """Bind the port (a taken one fails before loading), build the stack, serve it over HTTP
    until a stop signal or a failure; the exit code."""
    sock = bind_socket(settings.host, settings.port)
    try:
        try:
            with _stop_on_signal():
                stack = build_from_settings(settings)
            freeze_startup_objects()  # no full collection walks the model while serving
        except _StoppedBeforeServing as exc:
            print(f"shardwise serve: {exc}: stopped before serving", file=sys.stderr, flush=True)
            return 0
        return run_http(stack, sock, settings)
    finally:
        sock.close()


def rank_argv(settings: ServeSettings) -> list[str]:
    """The resolved settings as ``shardwise serve`` options, for every rank to parse again."""
    argv = ["--model", str(settings.model_path), "--device", settings.device,
            "--dtype", {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[settings.dtype],
            "--tp", str(settings.tp), "--pp", str(settings.pp),
            "--inject" if settings.inject else "--no-inject",
            "--graphs" if settings.graphs else "--no-graphs",
            "--host", settings.host, "--port", str(settings.port),
            "--served-model-name", settings.name, "--max-batch", str(settings.max_batch),
            "--max-waiting", str(settings.max_waiting),
            "--prefill-budget", str(settings.prefill_budget),
            "--prefill-stall", repr(settings.prefill_stall),
            "--drain-timeout", repr(settings.drain_timeout)]
    if settings.max_tokens is not None:
        argv += ["--max-tokens", str(settings.max_tokens)]
    if settings.pp > 1:
        argv += ["--micro-batches", str(settings.micro_batches)]
    if settings.quant:
        argv += ["--quant", settings.quant]
    if settings.weight_dtype:
        argv += ["--weight-dtype", settings.weight_dtype]
    if settings.comm_timeout is not None:
        argv += ["--comm-timeout", repr(settings.comm_timeout)]
    return argv


def launch_command(settings: ServeSettings) -> list[str]:
    """``python -m shardwise.launch --nproc-per-node N --standalone -m shardwise.serve.rank_main
    <options>``: the ranks on this node, each set up for the device."""
    from ..launch import module_command

    return module_command(RANK_MODULE, rank_argv(settings), settings.ranks,
                          device=settings.device)


def rank_process(root_pid: int, rank: int):
    """The ``psutil.Process`` of ``--tp`` rank ``rank`` among the descendants of ``root_pid``
    (the launcher, or the serve process above it); None when it is gone."""
    import psutil

    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:
            if RANK_MODULE in " ".join(child.cmdline()) \
                    and child.environ().get("RANK") == str(rank):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        root = psutil.Process(pid)
        for proc in [*root.children(recursive=True), root]:
            proc.kill()
    except psutil.NoSuchProcess:
        pass


class _TPStopper:
    """The ``--tp`` / ``--pp`` parent's signal handler: the first signal asks rank 0 to drain
    and stop (SIGTERM: it closes the runner, so the other ranks leave their follow loop and the
    launcher exits 0); if the ranks are still up ``drain_timeout`` + :data:`TP_STOP_GRACE_S`
    later, the launcher gets SIGTERM (it stops every rank), and as long again later they are
    killed."""

    def __init__(self, launcher: subprocess.Popen, drain_s: float) -> None:
        self.launcher = launcher
        self.drain_s = drain_s
        self.signalled = False

    def __call__(self, sig: int, frame) -> None:
        if self.signalled:  # a second signal: stop the launcher now
            self._signal_launcher()
            return
        self.signalled = True
        rank0 = rank_process(self.launcher.pid, 0)
        print(f"shardwise serve: {signal.Signals(sig).name}: stopping the ranks", file=sys.stderr,
              flush=True)
        if rank0 is None:
            self._signal_launcher()
        else:
            rank0.send_signal(signal.SIGTERM)
        threading.Thread(target=self._escalate, name="shardwise-tp-stop", daemon=True).start()

    def _signal_launcher(self) -> None:
        if self.launcher.poll() is None:
            self.launcher.send_signal(signal.SIGTERM)

    def _escalate(self) -> None:
        try:
            self.launcher.wait(self.drain_s + TP_STOP_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            self._signal_launcher()
        try:
            self.launcher.wait(TP_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            _kill_tree(self.launcher.pid)


def serve_tp(settings: ServeSettings) -> int:
    """The ``--tp N`` / ``--pp P`` parent: check the port is free, start the ranks through
    ``shardwise launch`` (in their own session, so a terminal's Ctrl-C reaches only this process,
    which forwards it), wait for the launcher; its exit code (0 after a clean stop)."""
    bind_socket(settings.host, settings.port).close()  # a taken port fails before any rank
    cmd = launch_command(settings)
    print(f"launching {settings.ranks} ranks: {' '.join(cmd)}", file=sys.stderr, flush=True)
    launcher = subprocess.Popen(cmd, start_new_session=True)
    stopper = _TPStopper(launcher, settings.drain_timeout)
    previous = {sig: signal.signal(sig, stopper) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = launcher.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if launcher.poll() is None:
            _kill_tree(launcher.pid)
    return code if code >= 0 else 1
