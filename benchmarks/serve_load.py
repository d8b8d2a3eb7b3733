"""Load benchmark of ``shardwise serve``: concurrent streaming clients against the HTTP server,
shardwise's continuous-batching stack and the plain Hugging Face model served one request at a
time (:class:`shardwise.serve.baseline.HFSerialBackend`), in the same run.

    python benchmarks/serve_load.py                                  # concurrency 1 and 8
    python benchmarks/serve_load.py --concurrency 1 4 8 16 --repeats 5 --requests-per-stream 4
    python benchmarks/serve_load.py --no-baseline --model path/to/hf-dir

Both servers run in this process (uvicorn on 127.0.0.1, a free port each, background threads;
the app is :func:`shardwise.serve.api.build_app`), on two copies of one model (default: the
embedded SmolLM2-135M-Instruct) in the device's preferred dtype. The clients run in
``--client-processes`` other processes (default 1), so that what is measured is the server: the
``openai`` client parses every chunk into pydantic objects, ~0.25 ms of Python per chunk on this
project's CPU, which in the server's process would hold the same GIL as the server's own
per-token work (``--client-processes 0`` runs them there, as before, for comparison). The
shardwise backend is the engine ``init_inference(model, replace_with_kernel_inject=True,
enable_graph=True)``, a :class:`~shardwise.serve.runner.SlotRunner` whose batch buckets are
captured before the first request, and the :class:`~shardwise.serve.scheduler.Scheduler`.

The load: at each concurrency C, C clients (``openai.AsyncOpenAI``) each send
``--requests-per-stream`` streaming ``/v1/completions`` requests one after the other
(temperature 0, ``max_tokens`` ``--max-tokens``, ``stream_options.include_usage``), the prompts
a fixed English text cut to 32-128 tokens, a different one per request. Per level:

* ``decode_tok_s``: generated tokens after each request's first, summed, over the level's wall
  time (first request sent to last stream ended);
* ``itl_ms`` p50/p99: the client-side gaps between a stream's successive chunks (the server
  sends one per token; the bare chunk that only closes a stream with its finish reason is left
  out), all streams pooled; ``ttft_ms`` p50/p99: request sent to first chunk;
* ``requests_s``: requests over the wall time.

Every level runs ``--repeats`` times, the backends interleaved (the baseline, then shardwise,
level by level), after one untimed warm-up level each; the table gives medians over repeats.
Ratios: shardwise at the highest concurrency over 1 stream (decode tokens/s), p99/p50 of the
inter-token latency, and shardwise over the baseline at each concurrency. The JSON
(``benchmarks/results/serve_load-<date>.json`` or ``--output``) holds the machine, versions, the
command, every request's samples and the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import datetime
import multiprocessing
import os
import platform
import queue
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from shardwise.bench.plan import QUANT_CONFIGS, engine_options
from shardwise.bench.report import check_writable, git_state, versions, write_json
from shardwise.bench.stats import median, percentile, ratio
from shardwise.errors import ConfigError

#: what the prompts are cut from (fixed, so every run sends the same text)
TEXT = (
    "The history of the lighthouse is a history of coasts, ships and the people who kept the "
    "lamps burning through long winter nights. Early lights were open fires on hills or towers, "
    "fed with wood or coal, and they were often hard to see in rain or fog. In the eighteenth "
    "century, oil lamps with polished reflectors made the beams stronger, and later the Fresnel "
    "lens, with its rings of glass prisms, gathered the light into a narrow beam that could be "
    "seen for many miles. Each lighthouse was given its own pattern of flashes, so that sailors "
    "could tell one from another at night. The keepers lived in small houses beside the towers, "
    "trimming wicks, cleaning the glass and writing the weather in their logbooks. Storms could "
    "cut them off from the mainland for weeks, and supplies came by boat when the sea allowed. "
    "With electricity and automatic machines, most lights no longer need a keeper, but many of "
    "the old towers still stand, and some have become museums where visitors climb the stairs "
    "to look out over the water and imagine the ships that passed in the dark.")
#: prompt lengths in tokens, one per request in turn (32-128)
PROMPT_LENGTHS = (32, 96, 48, 128, 64, 112, 40, 80)
#: every wait ends: each request (seconds)
REQUEST_TIMEOUT_S = 600.0
#: the longest a level's client processes may take to report (seconds)
LEVEL_TIMEOUT_S = 2 * REQUEST_TIMEOUT_S


# ----- options ------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8],
                        help="concurrent streams per level (default: 1 8)")
    parser.add_argument("--requests-per-stream", type=int, default=4,
                        help="requests each stream sends one after the other (default: 4)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="max_tokens of every request (default: 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per level")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                        help="also serve the plain HF model one request at a time (default: on)")
    parser.add_argument("--baseline-levels", type=int, nargs="+", default=None,
                        help="the concurrency levels the HF baseline runs at (default: every "
                             "level; it serves one request at a time, so its tokens/s do not "
                             "grow with streams, and a large model at many streams takes long)")
    parser.add_argument("--model", default=None,
                        help="HF model directory or GGUF file (default: the embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="shardwise's batch slots (default: the highest concurrency)")
    parser.add_argument("--max-context", type=int, default=512,
                        help="tokens per sequence (prompt + generated) the servers hold "
                             "(default: 512)")
    parser.add_argument("--prefill-budget", type=int, default=None,
                        help="the most prompt tokens shardwise's scheduler prefills in one step "
                             "(default: the server's)")
    parser.add_argument("--prefill-stall", type=float, default=None,
                        help="while streams decode, the most one step's prefill may take, as a "
                             "fraction of the typical decode step (default: the server's; "
                             "inter-token gaps stay within 1 + this many typical steps)")
    parser.add_argument("--prefill-worth", action=argparse.BooleanOptionalAction, default=None,
                        help="while streams decode, a prefill chunk takes at least the tokens "
                             "its call's overhead is worth, even past --prefill-stall "
                             "(default: the server's, on); --no-prefill-worth: the stall "
                             "bound first")
    parser.add_argument("--mixed", action=argparse.BooleanOptionalAction, default=None,
                        help="prefill prompt chunks inside the decode step (default: the "
                             "server's, on); --no-mixed: prefill and decode steps alternate")
    parser.add_argument("--quant", choices=sorted(QUANT_CONFIGS), default=None,
                        help="shardwise's weights quantized as `shardwise serve --quant` does "
                             "(default: none; the HF baseline stays unquantized)")
    parser.add_argument("--client-processes", type=int, default=1,
                        help="processes the clients run in, the streams spread over them "
                             "(default: 1; 0: in the servers' process, sharing their GIL)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch's intra-op threads for both servers (default: torch's own; "
                             "on a CPU shared with other work, 1 avoids OpenMP threads waiting "
                             "for each other at every parallel region)")
    parser.add_argument("--output", default=None,
                        help="JSON file (default: benchmarks/results/serve_load-<date>.json)")
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ConfigError as exc:
        parser.error(str(exc))
    return args


def check_args(args: argparse.Namespace) -> None:
    """Refuse bad options before any model is loaded."""
    for name in ("requests_per_stream", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads must be ≥ 1, got {args.threads}")
    if args.client_processes < 0:
        raise ConfigError(f"--client-processes must be ≥ 0 (0: in this process), got "
                          f"{args.client_processes}")
    if min(args.concurrency) < 1:
        raise ConfigError(f"--concurrency levels must be ≥ 1, got {args.concurrency}")
    args.concurrency = sorted(set(args.concurrency))
    levels = args.baseline_levels or args.concurrency
    if not set(levels) <= set(args.concurrency):
        raise ConfigError(f"--baseline-levels {levels} must be among --concurrency "
                          f"{args.concurrency}")
    args.baseline_levels = sorted(set(levels))
    if args.max_batch is None:
        args.max_batch = max(args.concurrency)
    if args.prefill_budget is not None and args.prefill_budget < 1:
        raise ConfigError(f"--prefill-budget must be ≥ 1, got {args.prefill_budget}")
    if args.prefill_stall is not None and not args.prefill_stall > 0:
        raise ConfigError(f"--prefill-stall must be > 0 (a fraction of a decode step), got "
                          f"{args.prefill_stall}")
    if args.max_batch < 1:
        raise ConfigError(f"--max-batch must be ≥ 1, got {args.max_batch}")
    if max(PROMPT_LENGTHS) + args.max_tokens > args.max_context:
        raise ConfigError(f"the longest prompt ({max(PROMPT_LENGTHS)} tokens) + --max-tokens "
                          f"({args.max_tokens}) exceeds --max-context ({args.max_context}); "
                          f"raise --max-context or lower --max-tokens")
    if args.model is not None:
        from shardwise.models import check_model_path

        check_model_path(args.model)
    if args.output is None:
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d-%H%M")
        args.output = str(Path(__file__).resolve().parent / "results" / f"serve_load-{date}.json")
    if not args.output.endswith(".json"):
        raise ConfigError(f"--output must end in .json, got {args.output!r}")
    check_writable(args.output)


# ----- prompts ------------------------------------------------------------------------------------

def build_prompts(tokenizer, lengths=PROMPT_LENGTHS) -> list[str]:
    """One prompt per length: :data:`TEXT` from a different sentence each, cut to about that
    many tokens (the server re-tokenizes; ``usage`` reports the exact count)."""
    sentences = TEXT.split(". ")
    prompts = []
    for i, length in enumerate(lengths):
        start = ". ".join(sentences[i % len(sentences):] + sentences[:i % len(sentences)])
        ids = tokenizer(start, add_special_tokens=False)["input_ids"][:length]
        prompts.append(tokenizer.decode(ids))
    return prompts


# ----- servers ------------------------------------------------------------------------------------

@dataclasses.dataclass
class Served:
    """One backend behind its HTTP server."""

    name: str
    backend: Any
    server: Any  # shardwise.serve.server.ServerThread
    model_name: str


def serve(name: str, backend, state) -> Served:
    from shardwise.serve.api import build_app
    from shardwise.serve.server import ServerThread

    server = ServerThread(build_app(state), graceful_s=5.0, join_s=30.0).start()
    return Served(name, backend, server, state.model_name)


def shardwise_stack(model, tokenizer, args, accelerator, name: str):
    """The server's own stack (:func:`shardwise.serve.server.build_stack`): the engine with
    kernel injection and graphs in the device's preferred dtype (``--quant``: its weights
    quantized) → a SlotRunner of
    ``--max-batch`` slots, every batch bucket captured → the Scheduler."""
    from shardwise.serve.server import build_stack

    budget = {k: getattr(args, k) for k in ("prefill_budget", "prefill_stall", "prefill_worth",
                                            "mixed") if getattr(args, k) is not None}
    return build_stack(model, tokenizer, max_batch=args.max_batch, max_tokens=args.max_context,
                       name=name, max_waiting=queue_bound(args), **budget,
                       dtype=accelerator.preferred_dtype,
                       **engine_options(inject=True, graphs=True, quant=args.quant))


def hf_state(model, tokenizer, args, name: str):
    """The baseline behind the same app: :class:`HFSerialBackend` on the plain model."""
    import shardwise
    from shardwise.serve.api import ServeState
    from shardwise.serve.baseline import HFSerialBackend
    from shardwise.serve.metrics import ServeMetrics

    metrics = ServeMetrics()
    backend = HFSerialBackend(model, tokenizer, max_tokens=args.max_context,
                              max_waiting=queue_bound(args), metrics=metrics,
                              release_threads=shardwise.get_accelerator().release_thread_pool)
    return ServeState(backend, tokenizer, name, args.max_context, metrics)


def queue_bound(args) -> int:
    """Room for every request of a level at once (none is ever refused with 429)."""
    return max(64, max(args.concurrency))


# ----- the load -----------------------------------------------------------------------------------

@dataclasses.dataclass
class RequestSample:
    """One streamed request, seen from the client (``time.monotonic()`` seconds: one clock for
    every process on the machine)."""

    stream: int
    prompt_index: int
    sent_s: float
    chunk_s: list[float]
    completion_tokens: int
    prompt_tokens: int
    text: str
    finish_reason: str | None

    @property
    def ttft_s(self) -> float:
        return self.chunk_s[0] - self.sent_s

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_s, self.chunk_s[1:])]


async def one_request(client, model_name: str, prompt: str, max_tokens: int, stream: int,
                      prompt_index: int) -> RequestSample:
    sent = time.monotonic()
    chunks, text, usage, finish = [], [], None, None
    response = await client.completions.create(
        model=model_name, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    async for chunk in response:
        now = time.monotonic()
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices:
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            if choice.text or choice.finish_reason is None:  # not the bare closing chunk
                chunks.append(now)
                text.append(choice.text or "")
    if usage is None or not chunks:
        raise RuntimeError(f"stream {stream}: the server sent no usage or no chunk")
    return RequestSample(stream, prompt_index, sent, chunks, usage.completion_tokens,
                         usage.prompt_tokens, "".join(text), finish)


@dataclasses.dataclass(frozen=True)
class StreamsJob:
    """Some of a level's streams, for one client process: stream ``s`` of ``streams`` sends
    its ``requests_per_stream`` requests in turn, the first at ``start_s`` (monotonic)."""

    url: str
    model_name: str
    prompts: tuple[str, ...]
    streams: tuple[int, ...]
    requests_per_stream: int
    max_tokens: int
    start_s: float


async def run_streams(job: StreamsJob) -> tuple[list[RequestSample], float]:
    """Run ``job``'s streams → their samples and when the last one ended (monotonic)."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{job.url}/v1", api_key="unused",
                                  max_retries=0, timeout=REQUEST_TIMEOUT_S) as client:

        async def stream(s: int) -> list[RequestSample]:
            out = []
            for r in range(job.requests_per_stream):
                index = (s * job.requests_per_stream + r) % len(job.prompts)
                out.append(await one_request(client, job.model_name, job.prompts[index],
                                             job.max_tokens, s, index))
            return out

        await asyncio.sleep(max(0.0, job.start_s - time.monotonic()))
        streams = await asyncio.gather(*(stream(s) for s in job.streams))
    return [r for rs in streams for r in rs], time.monotonic()


def _client_worker(jobs, results) -> None:
    """A client process: run each :class:`StreamsJob` from ``jobs`` until None, answering
    ``("ok", [sample dicts], end_s)`` or ``("error", text)`` on ``results``."""
    while (job := jobs.get()) is not None:
        try:
            samples, end = asyncio.run(run_streams(job))
            results.put(("ok", [dataclasses.asdict(r) for r in samples], end))
        except BaseException as exc:  # noqa: BLE001 - reported by the parent
            results.put(("error", f"{type(exc).__name__}: {exc}", 0.0))


class Clients:
    """Where the load's streams run: ``processes`` spawned client processes (the streams
    spread round-robin over them), or this process when 0. Use as a context manager."""

    #: how far ahead of now a level's start is set, so every process starts together
    START_DELAY_S = 0.2

    def __init__(self, processes: int) -> None:
        self.processes = processes
        context = multiprocessing.get_context("spawn")
        self._jobs = [context.Queue() for _ in range(processes)]
        self._results = context.Queue()
        self._workers = [context.Process(target=_client_worker, args=(q, self._results),
                                         name=f"serve-load-client-{i}", daemon=True)
                         for i, q in enumerate(self._jobs)]

    def __enter__(self) -> "Clients":
        for worker in self._workers:
            worker.start()
        return self

    def __exit__(self, *exc) -> None:
        for jobs in self._jobs:
            jobs.put(None)
        for worker in self._workers:
            worker.join(10)
            if worker.is_alive():
                worker.kill()

    def run(self, served: Served, prompts: list[str], concurrency: int,
            requests_per_stream: int, max_tokens: int) -> tuple[list[RequestSample], float]:
        """One level → (every request's sample, wall seconds: first sent to last ended)."""
        start = time.monotonic() + (self.START_DELAY_S if self.processes else 0.0)
        jobs = [StreamsJob(served.server.url, served.model_name, tuple(prompts),
                           tuple(range(i, concurrency, max(self.processes, 1))),
                           requests_per_stream, max_tokens, start)
                for i in range(min(max(self.processes, 1), concurrency))]
        if not self.processes:
            samples, end = asyncio.run(run_streams(jobs[0]))
            return samples, end - start
        for job_queue, job in zip(self._jobs, jobs):
            job_queue.put(job)
        samples, end = [], start
        for received in range(len(jobs)):
            try:
                status, body, ended = self._results.get(timeout=LEVEL_TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(
                    f"{served.name} at {concurrency} streams x {requests_per_stream} requests of "
                    f"{max_tokens} tokens: {len(jobs) - received} of {len(jobs)} client "
                    f"processes sent no result within {LEVEL_TIMEOUT_S:g} s (the level's "
                    f"limit); the server is stalled or far slower than expected (look at its "
                    f"/metrics, or run fewer --concurrency / --requests-per-stream)") from None
            if status != "ok":
                raise RuntimeError(f"{served.name} at {concurrency} streams: a client process "
                                   f"failed: {body}")
            samples += [RequestSample(**d) for d in body]
            end = max(end, ended)
        return samples, end - start


def run_level(clients: Clients, served: Served, prompts: list[str], concurrency: int,
              requests_per_stream: int, max_tokens: int) -> dict[str, Any]:
    """``concurrency`` streams, each sending its requests in turn → the level's samples and
    figures."""
    samples, wall = clients.run(served, prompts, concurrency, requests_per_stream, max_tokens)
    samples.sort(key=lambda r: (r.stream, r.sent_s))
    return {"wall_s": wall, "figures": level_figures(samples, wall),
            "requests": [dataclasses.asdict(r) for r in samples]}


def level_figures(samples: list[RequestSample], wall_s: float) -> dict[str, float]:
    """The figures of one level's run (see the module docstring)."""
    gaps = [g for r in samples for g in r.gaps_s]
    ttft = [r.ttft_s for r in samples]
    decode_tokens = sum(max(r.completion_tokens - 1, 0) for r in samples)
    figures = {"decode_tok_s": decode_tokens / wall_s, "requests_s": len(samples) / wall_s,
               "ttft_ms_p50": 1e3 * percentile(ttft, 50), "ttft_ms_p99": 1e3 * percentile(ttft, 99),
               "completion_tokens": sum(r.completion_tokens for r in samples),
               "chunks": sum(len(r.chunk_s) for r in samples)}
    if gaps:
        figures |= {"itl_ms_p50": 1e3 * percentile(gaps, 50),
                    "itl_ms_p99": 1e3 * percentile(gaps, 99)}
    return figures


# ----- the run ------------------------------------------------------------------------------------

def load_models(args, accelerator):
    """``(model for shardwise, model for the baseline or None, tokenizer)`` in the device's
    preferred dtype."""
    from shardwise.bench.runner import quiet_loader_bars
    from shardwise.models import default_model_path, load_model

    path = Path(args.model) if args.model else default_model_path()
    gguf = path.suffix == ".gguf"
    with quiet_loader_bars():
        # as the bench does: a GGUF file is read in its own dtype and cast after
        model, tokenizer = load_model(path, None if gguf else accelerator.preferred_dtype)
    model.to(dtype=accelerator.preferred_dtype)
    if tokenizer is None:
        raise ConfigError(f"{args.model}: no tokenizer next to the model; the server needs one")
    baseline = copy.deepcopy(model) if args.baseline else None
    return model, baseline, tokenizer


def machine(accelerator) -> dict[str, Any]:
    revision, dirty = git_state()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": accelerator.name, "device_name": accelerator.device_name(),
            "threads": torch.get_num_threads(), "dtype": str(accelerator.preferred_dtype),
            "versions": versions(), "git_revision": revision, "git_dirty": dirty,
            "platform": platform.platform(), "load_average": list(load_average())}


def load_average() -> tuple[float, ...]:
    try:
        return os.getloadavg()
    except OSError:
        return ()


def run(args) -> dict[str, Any]:
    import shardwise

    accelerator = shardwise.get_accelerator()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, hf_model, tokenizer = load_models(args, accelerator)
    name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    prompts = build_prompts(tokenizer)
    doc: dict[str, Any] = {"schema": "shardwise-serve-load/1", "command": command_line(),
                           "machine": machine(accelerator), "options": vars(args).copy(),
                           "prompt_lengths": list(PROMPT_LENGTHS), "backends": {}}
    servers: list[Served] = []
    try:
        if hf_model is not None:
            state = hf_state(hf_model, tokenizer, args, name)
            servers.append(serve("hf", state.backend, state))
        print("shardwise: init_inference and the capture of every batch bucket ...",
              file=sys.stderr)
        stack = shardwise_stack(model, tokenizer, args, accelerator, name)
        servers.append(serve("shardwise", stack.state.backend, stack.state))
        from shardwise.serve.server import freeze_startup_objects

        freeze_startup_objects()  # as `shardwise serve` does once its stack is built
        levels = {s.name: args.baseline_levels if s.name == "hf" else args.concurrency
                  for s in servers}
        with Clients(args.client_processes) as clients:
            runs = run_levels(clients, servers, levels, prompts, args)
    finally:
        for served in servers:
            served.server.stop()
            served.backend.stop(drain_s=5.0)
    for backend_name, levels in runs.items():
        doc["backends"][backend_name] = {
            str(c): {"repeats": reps, "median": median_figures(reps)} for c, reps in levels.items()}
    doc["ratios"] = ratios(doc, args.concurrency)
    doc["greedy_agreement"] = agreement(runs)
    doc["machine"]["load_average_end"] = list(load_average())
    return doc


def run_levels(clients: Clients, servers: list[Served], levels: dict[str, list[int]],
               prompts: list[str], args) -> dict[str, dict[int, list]]:
    """Every level of every server, ``--repeats`` times, after one untimed warm-up level each
    → ``{server: {concurrency: [level results]}}``."""
    for served in servers:  # untimed: first requests warm allocators, tokenizer, sockets
        run_level(clients, served, prompts, max(levels[served.name]), 1, args.max_tokens)
    runs = {s.name: {c: [] for c in levels[s.name]} for s in servers}
    for repeat in range(args.repeats):
        for c in args.concurrency:
            for served in [s for s in servers if c in levels[s.name]]:
                result = run_level(clients, served, prompts, c, args.requests_per_stream,
                                   args.max_tokens)
                result["load_average"] = list(load_average())
                runs[served.name][c].append(result)
                f = result["figures"]
                print(f"repeat {repeat + 1}/{args.repeats} {served.name:>9} C={c:<3} "
                      f"{f['decode_tok_s']:7.1f} tok/s  ITL p50 {f.get('itl_ms_p50', 0):6.1f}"
                      f" ms  TTFT p50 {f['ttft_ms_p50']:7.1f} ms", file=sys.stderr)
    return runs


def median_figures(repeats: list[dict]) -> dict[str, float]:
    keys = repeats[0]["figures"].keys()
    return {k: median([r["figures"][k] for r in repeats]) for k in keys
            if all(k in r["figures"] for r in repeats)}


def ratios(doc: dict, levels: list[int]) -> dict[str, Any]:
    """The ratios the issue asks for, from the medians."""
    sw = {int(c): v["median"] for c, v in doc["backends"]["shardwise"].items()}
    hf = {int(c): v["median"] for c, v in doc["backends"].get("hf", {}).items()}
    low, high = min(levels), max(levels)
    out: dict[str, Any] = {
        f"shardwise_decode_tok_s_{high}_over_{low}": ratio(sw[high]["decode_tok_s"],
                                                           sw[low]["decode_tok_s"]),
        "shardwise_itl_p99_over_p50": {c: ratio(sw[c].get("itl_ms_p99"), sw[c].get("itl_ms_p50"))
                                       for c in levels}}
    if hf:
        both = [c for c in levels if c in hf]
        out["shardwise_over_hf_decode_tok_s"] = {
            c: ratio(sw[c]["decode_tok_s"], hf[c]["decode_tok_s"]) for c in both}
        out["hf_over_shardwise_ttft_p50"] = {
            c: ratio(hf[c]["ttft_ms_p50"], sw[c]["ttft_ms_p50"]) for c in both}
        out["hf_itl_p99_over_p50"] = {c: ratio(hf[c].get("itl_ms_p99"), hf[c].get("itl_ms_p50"))
                                      for c in both}
        if high not in hf:  # HF serves one request at a time: its best level stands for all
            best = max(hf, key=lambda c: hf[c]["decode_tok_s"])
            out[f"shardwise_{high}_over_hf_serial_{best}"] = ratio(
                sw[high]["decode_tok_s"], hf[best]["decode_tok_s"])
    return out


def agreement(runs: dict) -> dict[str, Any] | None:
    """How many greedy completions shardwise and the baseline agree on, text for text (both in
    the same dtype, so small differences in rounding can change a token)."""
    if "hf" not in runs:
        return None
    texts = {}
    for backend_name, levels in runs.items():
        texts[backend_name] = {r["prompt_index"]: r["text"] for reps in levels.values()
                               for rep in reps for r in rep["requests"]}
    common = sorted(set(texts["hf"]) & set(texts["shardwise"]))
    same = sum(texts["hf"][i] == texts["shardwise"][i] for i in common)
    return {"prompts": len(common), "identical": same}


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in ["python", *sys.argv])


# ----- the table ----------------------------------------------------------------------------------

def table(doc: dict) -> str:
    rows = ["| backend | streams | decode tok/s | ITL p50 / p99 ms | TTFT p50 / p99 ms | req/s |",
            "|---|---|---|---|---|---|"]
    for backend_name, levels in doc["backends"].items():
        for c, level in levels.items():
            m = level["median"]
            rows.append(f"| {backend_name} | {c} | {m['decode_tok_s']:.1f} | "
                        f"{m.get('itl_ms_p50', float('nan')):.1f} / "
                        f"{m.get('itl_ms_p99', float('nan')):.1f} | {m['ttft_ms_p50']:.0f} / "
                        f"{m['ttft_ms_p99']:.0f} | {m['requests_s']:.2f} |")
    lines = ["\n".join(rows), ""]
    for key, value in doc["ratios"].items():
        if isinstance(value, dict):
            value = ", ".join(f"{c}: {v:.2f}x" for c, v in value.items() if v is not None)
        elif value is not None:
            value = f"{value:.2f}x"
        lines.append(f"{key}: {value}")
    start, end = doc["machine"].get("load_average"), doc["machine"].get("load_average_end")
    if start and end:
        lines.append(f"load average (1/5/15 min) at start {start[0]:.1f}/{start[1]:.1f}/"
                     f"{start[2]:.1f}, at end {end[0]:.1f}/{end[1]:.1f}/{end[2]:.1f} on "
                     f"{os.cpu_count()} CPUs")
    if doc.get("greedy_agreement"):
        g = doc["greedy_agreement"]
        lines.append(f"greedy completions identical to the baseline's: {g['identical']} of "
                     f"{g['prompts']} prompts")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc = run(args)
    path = write_json(doc, args.output)
    print(table(doc))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
