"""``shardwise serve``: bad options fail fast (exit 2, one line naming the problem, before any
model loads); a real server process answers the ``openai`` client a greedy completion equal to
Hugging Face ``generate``; SIGTERM during a stream ends the stream and the process (exit 0);
``--tp 2`` answers the same completion (and several prompts sent at once each HF's), and
killing rank 1 makes the server exit non-zero
within the collective timeout.

Every subprocess runs with a deadline and is killed (with its children) in a ``finally``."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch
import transformers
from openai import APIError, OpenAI

import shardwise.models
import shardwise.serve.server as server_module
from shardwise.cli import main
from shardwise.plugins import get_accelerator
from shardwise.serve.scheduler import DEFAULT_PREFILL_STALL

from models import tiny_causal_lm, tiny_tokenizer

#: the prompt every completion here continues, and how many tokens it asks for
PROMPT = "t5 t17 t42 t7 t99"
NEW_TOKENS = 8
#: seconds a server may take from start to its ready line (model load, injection, warmup)
READY_S = 60.0
#: --comm-timeout of the --tp server, and how much longer its exit may take after rank 1 dies
COMM_TIMEOUT_S = 5.0
EXIT_MARGIN_S = 20.0
READY_LINE = re.compile(r"^serving (\S+) on (http://\S+) \((.*)\)$")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama (256 positions) and its word-level tokenizer, saved with save_pretrained."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_causal_lm("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


#: prompts of different lengths sent at once to the --tp 2 server (one word per token)
CONCURRENT = ("t5", "t9 t33 t71", PROMPT, "t200 t3 t150 t77 t12 t19 t60 t8 t91 t44 t23")


def hf_greedy(model_dir, prompts) -> dict[str, tuple[str, int]]:
    """Plain HF greedy ``generate`` of each prompt alone from the saved model: prompt → (the
    text it adds to the prompt's, new tokens). The word-level tokenizer makes one word per
    token: compare ``.split()``."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    texts = {}
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        prompt = tokenizer.decode(ids[0], skip_special_tokens=True)
        texts[text] = (tokenizer.decode(out[0], skip_special_tokens=True)[len(prompt):],
                       out.shape[1] - ids.shape[1])
    return texts


@pytest.fixture(scope="module")
def hf_completion(model_dir) -> str:
    """HF's greedy completion of PROMPT (:func:`hf_greedy`), the full NEW_TOKENS long."""
    text, new = hf_greedy(model_dir, [PROMPT])[PROMPT]
    assert new == NEW_TOKENS  # no early end: the full length compares
    return text


# ----- bad options: exit 2 and a message, before loading ----------------------------------------

@pytest.fixture
def no_loading(monkeypatch):
    """Loading a model or starting ranks fails the test: the options must be refused first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the server started work for options it should have refused")
    monkeypatch.setattr(shardwise.models, "load_model", refuse)
    monkeypatch.setattr(server_module, "build_from_settings", refuse)
    monkeypatch.setattr(server_module, "serve_tp", refuse)


def serve_error(capsys, *argv: str) -> str:
    """Run ``shardwise serve ARGV`` in-process; assert exit code 2 and no traceback; the
    error line."""
    try:
        code = main(["serve", *argv])
    except SystemExit as exc:  # argparse's own refusals (choices, types)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def test_unknown_quant(capsys, no_loading):
    line = serve_error(capsys, "--quant", "int3")
    assert "--quant" in line and "int3" in line and "int8" in line


def test_max_batch_zero(capsys, no_loading, model_dir):
    line = serve_error(capsys, "--model", str(model_dir), "--max-batch", "0")
    assert "--max-batch must be at least 1" in line


@pytest.mark.parametrize("stall", ["0", "-0.5", "nan", "inf"])
def test_prefill_stall_not_a_positive_fraction(capsys, no_loading, model_dir, stall):
    line = serve_error(capsys, "--model", str(model_dir), "--prefill-stall", stall)
    assert "--prefill-stall must be a finite number > 0" in line and stall in line


def test_missing_model_dir(capsys, no_loading, tmp_path):
    missing = tmp_path / "nowhere"
    line = serve_error(capsys, "--model", str(missing))
    assert f"model path {str(missing)!r} does not exist" in line


@pytest.mark.parametrize("port", ["-1", "65536"])
def test_port_out_of_range(capsys, no_loading, model_dir, port):
    line = serve_error(capsys, "--model", str(model_dir), "--port", port)
    assert "--port must be a TCP port from 0 to 65535" in line and port in line


def test_tp_beyond_the_ranks_of_this_node(capsys, no_loading, model_dir):
    limit = get_accelerator("cpu").max_ranks_per_node()
    line = serve_error(capsys, "--model", str(model_dir), "--device", "cpu",
                       "--tp", str(limit + 1))
    assert f"--tp {limit + 1} needs {limit + 1} ranks" in line and \
        f"ask for {limit} ranks or fewer" in line
    line = serve_error(capsys, "--model", str(model_dir), "--device", "cpu", "--pp", "2",
                       "--tp", str(limit))
    assert f"--tp {limit} x --pp 2 needs {2 * limit} ranks" in line


def test_micro_batches_need_pipeline_stages(capsys, no_loading, model_dir):
    line = serve_error(capsys, "--model", str(model_dir), "--micro-batches", "2")
    assert "--micro-batches splits a decode step between pipeline stages" in line and \
        "--pp > 1" in line
    line = serve_error(capsys, "--model", str(model_dir), "--pp", "0")
    assert "--pp must be at least 1, got 0" in line


def test_port_in_use(capsys, no_loading, model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        line = serve_error(capsys, "--model", str(model_dir), "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in line and "another --port" in line


def test_model_without_tokenizer(capsys, no_loading, tmp_path):
    tiny_causal_lm("llama").save_pretrained(tmp_path)
    line = serve_error(capsys, "--model", str(tmp_path))
    assert "has no tokenizer" in line and "tokenizer.save_pretrained(DIR)" in line


def test_max_tokens_beyond_the_context(capsys, no_loading, model_dir):
    line = serve_error(capsys, "--model", str(model_dir), "--max-tokens", "257")
    assert "--max-tokens 257 is more than the model's context of 256 positions" in line


def test_no_inject_for_a_causal_model(capsys, no_loading, model_dir):
    line = serve_error(capsys, "--model", str(model_dir), "--no-inject")
    assert "--no-inject" in line and "replace_with_kernel_inject" in line


def test_defaults_come_from_the_accelerator(model_dir):
    """Without variant options: injection, graphs where the device's strategy accelerates, its
    preferred dtype; --max-tokens the model's context (256 here, under the cap)."""
    from shardwise.cli.serve import rank_parser

    accelerator = get_accelerator("cpu")
    args = rank_parser("t").parse_args(["--model", str(model_dir), "--device", "cpu"])
    settings = server_module.resolve_settings(args)
    assert settings.inject is True
    assert settings.graphs is accelerator.graph_strategy().accelerates
    assert settings.dtype == str(accelerator.preferred_dtype).removeprefix("torch.")
    assert settings.max_tokens == 256 and settings.name == model_dir.name
    assert settings.prefill_stall == DEFAULT_PREFILL_STALL == 1.0
    # the ranks of --tp parse what the parent resolved back to the same settings
    again = server_module.resolve_settings(rank_parser("t").parse_args(
        server_module.rank_argv(settings)))
    assert again == settings
    # and with pipeline stages: whole decode steps unless --micro-batches asks for more
    staged = server_module.resolve_settings(rank_parser("t").parse_args(
        ["--model", str(model_dir), "--device", "cpu", "--pp", "2"]))
    assert staged.ranks == 2 and staged.micro_batches == 1
    assert staged.engine_options(64)["pipeline_parallel"] == {"pp_size": 2}
    assert staged.describe().endswith("tp=1, pp=2")
    split = server_module.resolve_settings(rank_parser("t").parse_args(
        ["--model", str(model_dir), "--device", "cpu", "--pp", "2", "--micro-batches", "4"]))
    assert split.engine_options(64)["pipeline_parallel"] == {"pp_size": 2, "micro_batches": 4}
    half = server_module.resolve_settings(rank_parser("t").parse_args(
        ["--model", str(model_dir), "--device", "cpu", "--dtype", "fp32", "--weight-dtype",
         "fp16"]))
    assert half.engine_options(64)["weight_dtype"] == "fp16" and "fp16 weights" in half.describe()
    steadier = server_module.resolve_settings(rank_parser("t").parse_args(
        ["--model", str(model_dir), "--device", "cpu", "--prefill-stall", "0.4"]))
    assert steadier.prefill_stall == 0.4
    for settings in (staged, split, half, steadier):
        assert server_module.resolve_settings(rank_parser("t").parse_args(
            server_module.rank_argv(settings))) == settings


def test_prefill_options_reach_the_scheduler(model_dir, monkeypatch):
    """--prefill-budget and --prefill-stall are what the served stack's scheduler is built with
    (the model load and the stack stubbed: their arguments are the test)."""
    from shardwise.cli.serve import rank_parser

    built = {}
    monkeypatch.setattr(server_module, "load", lambda settings: (None, None, 64))
    monkeypatch.setattr(server_module, "build_stack",
                        lambda model, tokenizer, **kwargs: built.update(kwargs))
    settings = server_module.resolve_settings(rank_parser("t").parse_args(
        ["--model", str(model_dir), "--device", "cpu", "--prefill-budget", "96",
         "--prefill-stall", "1.5"]))
    server_module.build_from_settings(settings)
    assert built["prefill_budget"] == 96 and built["prefill_stall"] == 1.5


@pytest.mark.parametrize("argv,match", [
    (["--weight-dtype", "fp16"], "add --dtype fp32"),
    (["--dtype", "fp32", "--weight-dtype", "bf16", "--quant", "int8"], "give one of them"),
    (["--dtype", "fp32", "--weight-dtype", "bf16", "--no-graphs"], "drop --no-graphs"),
])
def test_weight_dtype_needs_fp32_graphs_and_no_quant(capsys, no_loading, model_dir, argv, match):
    line = serve_error(capsys, "--model", str(model_dir), "--device", "cpu", *argv)
    assert "--weight-dtype" in line and match in line


# ----- the stack and the HTTP loop, in this process ----------------------------------------------

def test_build_stack_of_an_encoder_serves_embeddings_only():
    """An encoder gets an Embedder and no runner or scheduler: /v1/embeddings answers HF's mean
    pooled, normalised last hidden state; completions are refused."""
    from serve_harness import openai_client, serving
    from shardwise.serve.api import build_app

    from models import tiny_encoder

    reference = tiny_encoder("bert", head="base")
    stack = server_module.build_stack(tiny_encoder("bert", head="base"), tiny_tokenizer(),
                                      max_tokens=64, name="enc", device="cpu", dtype="fp32",
                                      replace_with_kernel_inject=True)
    assert stack.runner is None and stack.scheduler is None
    ids = [5, 17, 42]
    with torch.no_grad():
        hidden = reference(input_ids=torch.tensor([ids])).last_hidden_state[0].mean(0)
    expected = torch.nn.functional.normalize(hidden, dim=0)
    with serving(build_app(stack.state)) as http:
        api = openai_client(http)
        got = api.embeddings.create(model="enc", input="t5 t17 t42").data[0].embedding
        torch.testing.assert_close(torch.tensor(got), expected, atol=1e-4, rtol=1e-4)
        with pytest.raises(APIError):
            api.completions.create(model="enc", prompt="t5", max_tokens=2)


class FailingBackend:
    """A backend whose model side fails when the test says so (``fail``)."""

    max_tokens = 64

    def __init__(self) -> None:
        self.failed = threading.Event()
        self.stopped: list[float] = []

    def submit(self, request, loop):
        raise AssertionError("no request is submitted in this test")

    def healthy(self) -> bool:
        return not self.failed.is_set()

    def stop(self, drain_s: float) -> None:
        self.stopped.append(drain_s)


def test_watchdog_exits_1_when_the_backend_fails(model_dir, monkeypatch):
    """uvicorn's loop checks the backend's health: /health is 200, then once the model side
    failed the server says why and run_http returns 1 (a timer would end the process if a
    model thread hung: recorded here instead)."""
    from shardwise.cli.serve import rank_parser
    from shardwise.serve.api import ServeState

    exits = []
    monkeypatch.setattr(server_module, "_exit_later", lambda code, delay: exits.append(code))
    settings = server_module.resolve_settings(rank_parser("t").parse_args(
        ["--model", str(model_dir), "--device", "cpu", "--port", "0"]))
    backend = FailingBackend()
    stack = server_module.Stack(None, None, backend,
                                ServeState(backend, tiny_tokenizer(), "tiny", 64, None))
    sock = server_module.bind_socket("127.0.0.1", 0)
    sock.listen(8)  # connections wait in the backlog until uvicorn accepts them
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(
        server_module.run_http(stack, sock, settings)), daemon=True)
    thread.start()
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=30) as health:
            assert health.status == 200
        backend.failed.set()
        thread.join(timeout=15)
        assert not thread.is_alive(), "the server did not stop after its backend failed"
        assert result == [1] and exits == [1]
        assert backend.stopped == []  # a failed model side is not drained
    finally:
        sock.close()


# ----- real server processes ---------------------------------------------------------------------

class ServerProcess:
    """``shardwise serve ARGV`` as a subprocess whose output lines are collected by a thread;
    :meth:`wait_ready` waits for the ready line (with a deadline) and gives the base URL."""

    def __init__(self, *argv: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "shardwise", "serve", *argv],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env)
        self.lines: list[str] = []
        self.started: list[psutil.Process] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)  # end of output: the process exited

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, timeout: float = READY_S) -> tuple[str, str]:
        """(base URL, the settings the ready line names)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no ready line within {timeout} s:\n{self.output()}")
            if line is None:
                raise AssertionError(f"the server exited ({self.proc.wait()}) before it was "
                                     f"ready:\n{self.output()}")
            found = READY_LINE.match(line)
            if found:
                self.started = self._descendants()  # to kill even if the parent exits first
                return found.group(2), found.group(3)

    def _descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """Kill the process and everything it started (the --tp launcher and ranks, also
        those left behind by a parent that already exited)."""
        if self.proc.poll() is None:
            self.proc.kill()
        for proc in {*self.started, *self._descendants()}:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait(10)


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)


def greedy_completion(url: str, model: str) -> str:
    answer = client(url).completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS,
                                            temperature=0)
    return answer.choices[0].text


def concurrent_completion(url: str, prompt: str, stream: bool) -> str:
    """A greedy completion of ``prompt`` (NEW_TOKENS at most), streamed or not: its text."""
    answer = client(url).completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS,
                                            temperature=0, stream=stream)
    if not stream:
        return answer.choices[0].text
    return "".join(chunk.choices[0].text for chunk in answer if chunk.choices)


def rank_process(root_pid: int, rank: int) -> psutil.Process:
    """The --tp rank ``rank`` among the server's descendants (its environment says RANK)."""
    proc = server_module.rank_process(root_pid, rank)
    assert proc is not None, f"no process of rank {rank} under {root_pid}"
    return proc


COMMON = ("--dtype", "fp32", "--no-graphs", "--port", "0", "--max-batch", "4",
          "--served-model-name", "tiny")


def test_serves_hf_greedy_then_sigterm_mid_stream_exits_0(model_dir, hf_completion):
    server = ServerProcess("--model", str(model_dir), "--device", "cpu", *COMMON,
                           "--drain-timeout", "0")  # running streams are cancelled at once
    try:
        url, described = server.wait_ready()
        assert described == "cpu, float32, inject, no graphs, no quant, tp=1"
        models = client(url).models.list()
        assert [m.id for m in models.data] == ["tiny"]
        assert greedy_completion(url, "tiny").split() == hf_completion.split()

        # a long stream; SIGTERM once its first token arrived
        stream = client(url).completions.create(model="tiny", prompt=PROMPT, max_tokens=240,
                                                temperature=0, stream=True)
        chunks = iter(stream)
        first = next(chunks)
        assert first.choices[0].text or first.choices[0].finish_reason
        server.proc.send_signal(signal.SIGTERM)
        finish = None
        try:
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
        except APIError as exc:  # cancelled by the drain: an error event ends the stream
            assert "cancelled" in str(exc) or "stopping" in str(exc), exc
            finish = "cancelled"
        assert finish in ("stop", "length", "cancelled")
        assert server.proc.wait(timeout=30) == 0, server.output()
        assert "SIGTERM" in server.output()
    finally:
        server.kill()


def assert_answers_are_hf(url: str, model_dir, hf_completion: str) -> None:
    """The server's greedy completion is the TP=1 server's (both HF's), and prompts of different
    lengths sent at once, streamed and not, each get HF's answer for it alone."""
    assert greedy_completion(url, "tiny").split() == hf_completion.split()
    expected = hf_greedy(model_dir, CONCURRENT)
    with ThreadPoolExecutor(len(CONCURRENT)) as pool:
        answers = list(pool.map(lambda i: concurrent_completion(url, CONCURRENT[i], i % 2 == 1),
                                range(len(CONCURRENT))))
    for text, answer in zip(CONCURRENT, answers):
        assert answer.split() == expected[text][0].split(), text


def test_tp2_same_completion_and_rank_death_exits_nonzero(model_dir, hf_completion):
    server = ServerProcess("--model", str(model_dir), "--device", "cpu", "--tp", "2", *COMMON,
                           "--comm-timeout", str(COMM_TIMEOUT_S))
    try:
        url, described = server.wait_ready(timeout=2 * READY_S)
        assert described.endswith("tp=2")
        assert_answers_are_hf(url, model_dir, hf_completion)
        rank_process(server.proc.pid, 1).kill()
        died = time.monotonic()
        try:
            code = server.proc.wait(timeout=COMM_TIMEOUT_S + EXIT_MARGIN_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the server still runs {COMM_TIMEOUT_S + EXIT_MARGIN_S} s after "
                                 f"rank 1 died:\n{server.output()}") from None
        assert code != 0, server.output()
        assert time.monotonic() - died < COMM_TIMEOUT_S + EXIT_MARGIN_S
    finally:
        server.kill()


def test_pp2_serves_concurrent_requests_as_micro_batches_through_the_stages(model_dir,
                                                                          hf_completion):
    """``--pp 2``: rank 0 the first stage (and HTTP), rank 1 the second; a decode step's
    sequences run whole or as micro-batches one behind the other (whichever warm-up measured
    faster). Each answer is HF's for its prompt alone."""
    server = ServerProcess("--model", str(model_dir), "--device", "cpu", "--pp", "2",
                           "--micro-batches", "4", *COMMON, "--comm-timeout", str(COMM_TIMEOUT_S))
    try:
        url, described = server.wait_ready(timeout=2 * READY_S)
        assert described.endswith("tp=1, pp=2 x 4 micro-batches")
        assert_answers_are_hf(url, model_dir, hf_completion)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0, server.output()
    finally:
        server.kill()


def test_tp2_sigterm_to_the_parent_stops_every_rank_with_exit_0(model_dir):
    """The --tp parent forwards SIGTERM to rank 0, which drains and closes the runner, so the
    follower leaves its loop and the launcher exits 0: no rank is left behind."""
    server = ServerProcess("--model", str(model_dir), "--device", "cpu", "--tp", "2", *COMMON,
                           "--comm-timeout", str(COMM_TIMEOUT_S), "--drain-timeout", "0")
    try:
        url, _ = server.wait_ready(timeout=2 * READY_S)
        ranks = [rank_process(server.proc.pid, r) for r in (0, 1)]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=30) == 0, server.output()
        gone, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive, f"ranks still running after the server exited: {alive}"
        assert "stopping the ranks" in server.output()
    finally:
        server.kill()
