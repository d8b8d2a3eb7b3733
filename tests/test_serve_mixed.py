"""Mixed steps (``SlotRunner.mixed``): one forward carrying a decode token of every running slot
AND prompt chunks of other slots (chunked prefill inside the decode batch) gives each sequence
what Hugging Face ``generate`` gives it alone, and the scheduler uses it so that running
streams get a token at every step while a long prompt prefills.

The runner scenario (this file's greedy loop): three sequences decode while a long prompt is
prefilled in chunks through mixed steps (the first chunk, a one-token chunk, two prompts'
chunks in one step, the final chunk giving the prompt's first token in the same forward as the
streams' tokens), then all decode to the end; every sequence's tokens equal HF ``generate`` of
its prompt alone and the logits are within ``FP32_ATOL`` of HF's (teacher forced). With graphs
(tests/graph_doubles.py) the decode-only steps replay the captured graphs; mixed steps are
captured per chunk bucket where the strategy replays host code (``replays_host_code``: the
CPU's compiled steps, :class:`HostReplay` here) or where every layer's ``attention_chunks``
reads the chunks' spans inside the op (CUDA graphs with Triton's kernel; ``RecordedReplay``
here, which replays only what it recorded), else they run eagerly, logged and counted.
"""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.errors import ConfigError
from shardwise.inject.cache import MaxTokensError
from shardwise.inject.slots import PACKED_CHUNKS
from shardwise.serve.runner import SlotRunner
from shardwise.serve.scheduler import MIN_PREFILL_CHUNK, Scheduler
from shardwise.serve.types import GenRequest, SamplingParams, TokenEvent
from graph_doubles import CountingReplay, RecordedReplay, engine_maker, replays
from models import prompt_ids, tiny_causal_lm
from slot_scenario import Seq, check_against_hf, hf_greedy, prefill, step

ARCHS = ["llama", "gpt2", "opt", "mixtral"]  # rotary, learned, learned with offset 2, MoE


@pytest.fixture(scope="module")
def engines():
    """(arch, graphs) -> (HF reference, injected engine), built once per module."""
    get, made = engine_maker()
    yield get
    made.clear()


class HostReplay(CountingReplay):
    """CountingReplay (it replays by calling the captured function) that says so: its
    captured steps run host code at every replay, so mixed steps are captured with it."""

    replays_host_code = True


def host_replay_engine(arch: str, max_tokens: int = 64):
    from shardwise.accelerators.cpu import CpuAccelerator

    original = CpuAccelerator.graph_strategy
    CpuAccelerator.graph_strategy = lambda self: HostReplay()
    try:
        return shardwise.init_inference(tiny_causal_lm(arch), device="cpu",
                                        replace_with_kernel_inject=True, enable_graph=True,
                                        max_tokens=max_tokens)
    finally:
        CpuAccelerator.graph_strategy = original


def mixed(runner: SlotRunner, running: list[Seq], chunks: list[tuple[Seq, int]]) -> list[Seq]:
    """One mixed step: a decode token for every running sequence and the next ``n`` prompt
    tokens of each ``(seq, n)`` of ``chunks`` (its slot already set). Returns the running ones
    (a prompt whose final chunk ran joins them)."""
    active = [s for s in running if not s.done]
    parts = []
    for seq, n in chunks:
        start = runner.length(seq.slot)
        parts.append((seq.slot, seq.prompt[start:start + n], start + n == len(seq.prompt)))
    logits, firsts = runner.mixed([s.slot for s in active], [s.tokens[-1] for s in active],
                                  parts)
    assert logits.shape == (len(active), runner.vocab_size) and logits.dtype == torch.float32
    for seq, row in zip(active, logits):
        seq.take(row)
    for (seq, _), (_, _, last), first in zip(chunks, parts, firsts):
        assert (first is None) == (not last)
        if first is not None:
            seq.take(first)
            running = running + [seq]
    return running


def mixed_scenario(runner: SlotRunner) -> list[Seq]:
    """A, B, C decode in slots 0, 1, 3; the long prompt L (slot 2) and E (slot 4) are
    prefilled through mixed steps while they decode; then everything decodes to the end."""
    prompts = [prompt_ids(1, n, seed=20 + n)[0].tolist() for n in (5, 7, 3, 23, 4)]
    a, b, c = Seq(prompts[0], 12), Seq(prompts[1], 10), Seq(prompts[2], 11)
    long_, e = Seq(prompts[3], 6), Seq(prompts[4], 5)
    prefill(runner, a, 0, [5])
    prefill(runner, b, 1, [7])
    prefill(runner, c, 3, [3])
    long_.slot, e.slot = 2, 4
    running = step(runner, [a, b, c])
    running = mixed(runner, running, [(long_, 8)])     # L's first chunk (nothing cached)
    running = mixed(runner, running, [(long_, 1)])     # a one-token chunk after cached ones
    running = mixed(runner, running, [(long_, 6), (e, 2)])  # two prompts in one step
    running = mixed(runner, running, [(e, 2), (long_, 8)])  # both final chunks: first tokens
    assert long_ in running and e in running and len(long_.tokens) == len(e.tokens) == 1
    while running:
        running = step(runner, running)
    return [a, b, c, long_, e]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_steps_give_each_sequence_its_greedy_hf_tokens(engines, arch, graphs):
    """Eager mixed steps: without graphs, and with graphs whose strategy replays what it
    recorded (CountingReplay does not say it replays host code) while the chunk attention
    reads its spans on the host (the CPU kernel declared not capturable here): the decode-only
    steps replay their graphs, the mixed ones run eagerly, logged and counted."""
    ref, engine = engines(arch, graphs)
    kernels = _chunk_kernels(engine)
    for k in kernels:
        k.chunks_capturable = False
    runner = SlotRunner(engine, max_batch=5, max_tokens=40)
    try:
        assert runner.supports_mixed and runner.mixed_unsupported is None
        runner.warmup()
        captured, replayed = CountingReplay.captures, replays()
        seqs = mixed_scenario(runner)
        worst = check_against_hf(ref, seqs)
        print(f"{arch} {'graphs' if graphs else 'eager'} mixed: max |logit diff| {worst:.2e}")
        assert all(runner.length(slot) == 0 for slot in range(5))
        if graphs:
            assert CountingReplay.captures == captured  # mixed steps captured nothing
            assert replays() > replayed  # the decode-only steps replayed captured graphs
            assert runner.mixed_steps == {"captured": 0, "eager": 4}
            assert "replays what it recorded" in runner.mixed_eager_reason
            assert "(cpu) reads the prompt chunks' ranges on the host" in \
                runner.mixed_eager_reason
    finally:
        runner.close()
        for k in kernels:
            k.chunks_capturable = True


def recorded_replay_engine(arch: str):
    """An injected CPU engine whose graphs replay what they recorded (RecordedReplay: a CUDA
    graph's semantics)."""
    from shardwise.accelerators.cpu import CpuAccelerator

    original = CpuAccelerator.graph_strategy
    CpuAccelerator.graph_strategy = lambda self: RecordedReplay()
    try:
        return shardwise.init_inference(tiny_causal_lm(arch), device="cpu",
                                        replace_with_kernel_inject=True, enable_graph=True,
                                        max_tokens=64)
    finally:
        CpuAccelerator.graph_strategy = original


@pytest.mark.parametrize("arch", [*ARCHS, "mistral-sw4", "bloom", "gpt_oss"])
def test_recorded_mixed_steps_replay_new_chunks_where_the_kernel_reads_spans_as_it_runs(arch):
    """A strategy that replays what it recorded (as CUDA graphs do) captures the mixed steps
    when every layer's ``attention_chunks`` reads the chunks' spans inside the op (the CPU
    backend's here, Triton's on a GPU): each captured step, replayed with other slots and
    chunks than it was recorded with, gives every sequence HF's greedy tokens — with a sliding
    window of 4 (mistral-sw4), ALiBi (bloom) and attention sinks (gpt_oss) too."""
    engine = recorded_replay_engine(arch)
    runner = SlotRunner(engine, max_batch=5, max_tokens=40, mixed_buckets=(8, 16))
    try:
        assert runner.stack.kernels.chunks_capturable
        assert runner.mixed_buckets == (8, 16) and runner.mixed_eager_reason is None
        runner.warmup()
        seqs = mixed_scenario(runner)
        worst = check_against_hf(tiny_causal_lm(arch), seqs)
        print(f"{arch} recorded mixed: max |logit diff| {worst:.2e}")
        assert runner.mixed_steps == {"captured": 4, "eager": 0}
    finally:
        runner.close()


def test_recorded_replay_freezes_a_chunk_kernel_that_reads_spans_on_the_host():
    """The test above is not vacuous: the reference ``attention_chunks`` (it reads the spans
    with ``.tolist()``), declared capturable, is recorded with the capture's spans, and the
    replayed mixed steps attend the wrong ranges: the tokens differ from HF's."""
    from shardwise.kernels.reference import attention as ref

    engine = recorded_replay_engine("llama")
    for kernels in _chunk_kernels(engine):
        kernels.attention_chunks = ref.attention_chunks
    runner = SlotRunner(engine, max_batch=5, max_tokens=40, mixed_buckets=(8, 16))
    try:
        runner.warmup()
        with pytest.raises(AssertionError):
            check_against_hf(tiny_causal_lm("llama"), mixed_scenario(runner))
        assert runner.mixed_steps["captured"] > 0
    finally:
        runner.close()


def _chunk_kernels(engine) -> list:
    """The distinct Kernels of the engine's injected layers."""
    from shardwise.inject.layers import Kernels

    found = {id(m.kernels): m.kernels for m in engine.module.modules()
             if isinstance(getattr(m, "kernels", None), Kernels)}
    assert found
    return list(found.values())


@pytest.mark.parametrize("chunk_kernel", [True, False], ids=["attention_chunks", "host-op"])
@pytest.mark.parametrize("arch", ARCHS)
def test_captured_mixed_steps_give_each_sequence_its_greedy_hf_tokens(arch, chunk_kernel):
    """Every mixed step of the scenario runs the captured step of its chunk bucket (8 or 16
    tokens, padded), captured by warmup and never again; tokens equal HF's, logits within
    FP32_ATOL. The chunks attend through the CPU backend's capturable ``attention_chunks``, or
    (a backend without one) through the host op ``chunks_by_prefill``."""
    engine = host_replay_engine(arch)
    for kernels in _chunk_kernels(engine):
        assert kernels.chunks_capturable  # the CPU backend's
        kernels.chunks_capturable = chunk_kernel
    runner = SlotRunner(engine, max_batch=5, max_tokens=40, mixed_buckets=(8, 16))
    try:
        assert runner.mixed_buckets == (8, 16) and runner.mixed_eager_reason is None
        assert runner.mixed_chunks == PACKED_CHUNKS
        runner.warmup()
        keys = set(runner.stack.graphs.graphs)
        assert {k for k in keys if isinstance(k, tuple) and k[0] == "slots-mixed"} == {
            runner.cache.packed_key(runner.cache.rows, b) for b in (8, 16)}
        captured = HostReplay.captures
        seqs = mixed_scenario(runner)
        worst = check_against_hf(tiny_causal_lm(arch), seqs)
        print(f"{arch} captured mixed: max |logit diff| {worst:.2e}")
        assert runner.mixed_steps == {"captured": 4, "eager": 0}
        assert HostReplay.captures == captured and set(runner.stack.graphs.graphs) == keys
    finally:
        runner.close()
    assert not any(isinstance(k, tuple) and k[0] == "slots-mixed"
                   for k in runner.stack.graphs.graphs)  # close dropped them


def test_compiled_mixed_steps_on_cpu_compile_once_per_bucket_and_match_hf():
    """The CPU's real graph strategy (inductor): warmup compiles one step per decode bucket
    and per chunk bucket, the scenario (mixed steps of every bucket, decode steps) compiles
    nothing more, and every sequence gets HF's greedy tokens."""
    engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                      replace_with_kernel_inject=True, enable_graph=True,
                                      max_tokens=64, dtype=torch.float32)
    strategy = engine.module.base_model.graphs.strategy
    assert strategy.replays_host_code
    runner = SlotRunner(engine, max_batch=5, max_tokens=40, mixed_buckets=(8, 16))
    try:
        before = strategy.compiles + strategy.loaded
        runner.warmup()
        # one step per decode bucket over the slot cache (its own buffers), one per chunk bucket
        assert strategy.compiles + strategy.loaded - before == len(runner.buckets()) + 2
        compiled = strategy.compiles
        check_against_hf(tiny_causal_lm("llama"), mixed_scenario(runner))
        assert runner.mixed_steps == {"captured": 4, "eager": 0}
        assert strategy.compiles == compiled  # no recompile while serving
    finally:
        runner.close()


def test_captured_mixed_step_padding_writes_no_real_cache_position():
    """A captured mixed step whose chunk (3 tokens) is padded to its bucket (8), over a cache
    of 4 rows with two idle rows: it writes exactly the decode tokens' and the chunk's
    positions and scratch positions; every other position of every row — the slots' cached
    tokens and everything past them — keeps its bytes."""
    engine = host_replay_engine("llama")
    runner = SlotRunner(engine, max_batch=4, max_tokens=16, mixed_buckets=(8,))
    try:
        runner.warmup()
        for t in runner.cache.buffers.tensors:
            t.copy_(torch.randn_like(t))  # every position holds its own bytes
        first = runner.prefill(0, [3, 4, 5], last=True)
        runner.prefill(2, [6, 7], last=False)
        before = [t.clone() for t in runner.cache.buffers.tensors]
        logits, firsts = runner.mixed([0], [int(first.argmax())], [(2, [8, 9, 10], True)])
        assert runner.mixed_steps["captured"] == 1 and logits.shape[0] == 1
        assert firsts[0] is not None and torch.isfinite(firsts[0]).all()
        written = {(0, 3), (2, 2), (2, 3), (2, 4)}  # (row, position)
        scratch = runner.cache.scratch
        for old, new in zip(before, runner.cache.buffers.tensors):
            changed = (old != new).any(dim=(1, 3))  # [rows, positions]
            for row, pos in changed.nonzero().tolist():
                assert (row, pos) in written or pos == scratch, (row, pos)
            for row, pos in written:
                assert changed[row, pos]
        assert [runner.length(s) for s in range(4)] == [4, 0, 5, 0]
    finally:
        runner.close()


def test_mixed_steps_the_strategy_cannot_capture_run_eagerly_logged_and_counted(caplog):
    """A strategy that does not replay host code (CountingReplay: as a CUDA graph, for the
    runner) with a chunk attention that reads its spans on the host (the CPU kernel declared
    not capturable here) keeps mixed steps eager: the runner says why once and counts them."""
    from shardwise.accelerators.cpu import CpuAccelerator

    original = CpuAccelerator.graph_strategy
    CpuAccelerator.graph_strategy = lambda self: CountingReplay()
    try:
        engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                          replace_with_kernel_inject=True, enable_graph=True,
                                          max_tokens=64)
    finally:
        CpuAccelerator.graph_strategy = original
    for kernels in _chunk_kernels(engine):
        kernels.chunks_capturable = False
    with caplog.at_level("WARNING", logger="shardwise.serve.runner"):
        runner = SlotRunner(engine, max_batch=3, max_tokens=16)
    try:
        assert runner.mixed_buckets == () and runner.mixed_chunks is None
        assert "mixed steps run eagerly" in caplog.text and "replay_on_cpu" in caplog.text
        first = runner.prefill(0, [3, 4, 5], last=True)
        runner.mixed([0], [int(first.argmax())], [(1, [6, 7], True)])
        assert runner.mixed_steps == {"captured": 0, "eager": 1}
    finally:
        runner.close()


def test_bad_mixed_buckets_are_refused():
    _, engine = engine_maker()[0]("llama", False)
    with pytest.raises(ConfigError, match="mixed_buckets must be ints >= 1"):
        SlotRunner(engine, max_batch=2, max_tokens=8, mixed_buckets=(8, 0))


def test_bad_mixed_calls_are_refused_before_any_work(engines):
    _, engine = engines("llama", False)
    runner = SlotRunner(engine, max_batch=3, max_tokens=8)
    first = runner.prefill(0, [3, 4, 5], last=True)
    token = int(first.argmax())
    with pytest.raises(ValueError, match="at least one prompt chunk"):
        runner.mixed([0], [token], [])
    with pytest.raises(ValueError, match="slot twice"):
        runner.mixed([0], [token], [(0, [1], True)])
    with pytest.raises(ValueError, match="slot twice"):
        runner.mixed([0], [token], [(1, [1], False), (1, [2], True)])
    with pytest.raises(MaxTokensError, match="max_tokens=8"):
        runner.mixed([0], [token], [(1, list(range(9)), True)])
    with pytest.raises(ValueError, match="holds no tokens"):
        runner.mixed([2], [token], [(1, [1], True)])
    with pytest.raises(ValueError, match="one decode token per slot"):
        runner.mixed([0], [token, token], [(1, [1], True)])
    assert [runner.length(s) for s in range(3)] == [3, 0, 0]  # nothing written
    runner.close()


def test_latent_attention_has_no_mixed_steps():
    engine = shardwise.init_inference(tiny_causal_lm("deepseek_v3-mla"), device="cpu",
                                      replace_with_kernel_inject=True, max_tokens=32)
    runner = SlotRunner(engine, max_batch=2, max_tokens=16)
    assert not runner.supports_mixed and "latent" in runner.mixed_unsupported
    runner.prefill(0, [3, 4], last=True)
    with pytest.raises(ConfigError, match="latent"):
        runner.mixed([0], [5], [(1, [1, 2], True)])
    runner.close()


# ----- the scheduler over a real runner ---------------------------------------------------------


class Recording:
    """A SlotRunner wrapper recording each forward: ("decode" | "prefill" | "mixed", the
    decode slots, the prompt tokens it carried)."""

    def __init__(self, runner: SlotRunner, mixed: bool = True) -> None:
        self.runner, self.calls = runner, []
        self.max_batch, self.max_tokens = runner.max_batch, runner.max_tokens
        self.vocab_size = runner.vocab_size
        self.supports_mixed = mixed
        self.mixed_unsupported = None if mixed else "switched off by the test"

    def prefill(self, slot, token_ids, last):
        self.calls.append(("prefill", [], len(token_ids)))
        return self.runner.prefill(slot, token_ids, last)

    def decode(self, slots, token_ids):
        self.calls.append(("decode", list(slots), 0))
        return self.runner.decode(slots, token_ids)

    def mixed(self, slots, token_ids, chunks):
        self.calls.append(("mixed", list(slots), sum(len(c[1]) for c in chunks)))
        return self.runner.mixed(slots, token_ids, chunks)

    def __getattr__(self, name):  # release, length, heartbeat, close
        return getattr(self.runner, name)


def request(prompt: list[int], new: int, rid: str) -> GenRequest:
    return GenRequest(id=rid, prompt_ids=prompt,
                      params=SamplingParams(max_tokens=new, temperature=0.0))


def run_long_prompt_scenario(engine, mixed_on: bool, budget: int):
    """Three streams decode; a long prompt arrives; the scheduler is stepped until all end.
    Returns (the recording runner, tokens per request, tokens per stream per step while the
    long prompt prefilled)."""
    recording = Recording(SlotRunner(engine, max_batch=4, max_tokens=64), mixed=mixed_on)
    scheduler = Scheduler(recording, prefill_budget=budget, prefill_stall=None)
    prompts = [prompt_ids(1, n, seed=40 + n)[0].tolist() for n in (5, 6, 4, 30)]
    handles = [scheduler.submit(request(p, 14, f"s{i}"), None) for i, p in enumerate(prompts[:3])]
    for _ in range(3):  # the streams are decoding
        scheduler.step()
    long_handle = scheduler.submit(request(prompts[3], 5, "long"), None)
    handles.append(long_handle)
    per_step, first_call = [], len(recording.calls)
    while not long_handle.completion_tokens:  # until the long prompt's first token
        before = [h.completion_tokens for h in handles[:3]]
        scheduler.step()
        per_step.append([h.completion_tokens - n for h, n in zip(handles[:3], before)])
    during = recording.calls[first_call:]  # the forwards while the long prompt prefilled
    while scheduler.step():
        pass
    tokens = []
    for handle in handles:
        events = []
        while not handle.queue.empty():
            events.append(handle.queue.get_nowait())
        assert events[-1].reason == "length"
        tokens.append([e.token_id for e in events if isinstance(e, TokenEvent)])
    scheduler.stop(0)
    return during, prompts, tokens, per_step


@pytest.mark.parametrize("mixed_on", [True, False], ids=["mixed", "alternating"])
def test_streams_get_a_token_every_step_while_a_long_prompt_prefills(engines, mixed_on):
    ref, engine = engines("llama", False)
    budget = 12  # 3 decode tokens + 9 prompt tokens per mixed step: the prompt takes 4 steps
    during, prompts, tokens, per_step = run_long_prompt_scenario(engine, mixed_on, budget)
    for prompt, got, new in zip(prompts, tokens, (14, 14, 14, 5)):
        assert got == hf_greedy(ref, prompt, new)  # exact, every request
    assert len(per_step) > 1  # the prompt was prefilled over several steps
    assert all(step == [1, 1, 1] for step in per_step)  # no stream skipped a step
    if mixed_on:  # ONE forward per step, carrying the 3 streams' tokens and 9 prompt tokens
        assert [c[0] for c in during] == ["mixed"] * len(per_step)
        assert [len(c[1]) for c in during] == [3] * len(per_step)
        assert [c[2] for c in during] == [9, 9, 9, 3]  # the budget split: 12 - 3 decode tokens
    else:  # the alternating steps: a prefill call, then a decode step, each iteration
        assert [c[0] for c in during] == ["prefill", "decode"] * len(per_step)
        assert [c[2] for c in during[::2]] == [12, 12, 6]


def test_scheduler_falls_back_to_alternating_steps_and_says_why(engines, caplog):
    _, engine = engines("llama", False)
    recording = Recording(SlotRunner(engine, max_batch=2, max_tokens=32), mixed=False)
    with caplog.at_level("INFO", logger="shardwise.serve.scheduler"):
        scheduler = Scheduler(recording)
    assert not scheduler.mixed
    assert "switched off by the test" in caplog.text
    scheduler.stop(0)


def test_captured_steps_chunks_fill_a_bucket():
    """With buckets the chunk tokens are the largest bucket within the budget (the smallest
    where none is), in at most max_chunks chunks; fewer prompt tokens than that are all taken
    (the runner pads them)."""
    from shardwise.serve.scheduler import split_step_budget

    buckets = (8, 16, 32, 64)
    assert split_step_budget(64, 3, [100], buckets=buckets) == [32]  # 61 would spill into 64
    assert split_step_budget(67, 3, [100], buckets=buckets) == [64]
    assert split_step_budget(500, 3, [100], buckets=buckets) == [64]  # the largest bucket
    assert split_step_budget(10, 3, [100], buckets=buckets) == [8]  # MIN_PREFILL_CHUNK
    assert split_step_budget(40, 3, [20, 100], buckets=buckets) == [20, 12]
    assert split_step_budget(40, 3, [5, 6], buckets=buckets) == [5, 6]  # padded to 16
    assert split_step_budget(40, 3, [2, 2, 2, 2], buckets=buckets, max_chunks=2) == [2, 2]


def test_scheduler_cuts_chunks_to_the_runner_buckets():
    """Over a runner with captured mixed steps, every mixed step's chunk tokens are a bucket,
    or all the prompt had left; none runs eagerly; every request gets HF's greedy tokens."""
    ref = tiny_causal_lm("llama")
    runner = SlotRunner(host_replay_engine("llama"), max_batch=4, max_tokens=64,
                        mixed_buckets=(8, 16))
    runner.warmup()
    recording = Recording(runner)
    scheduler = Scheduler(recording, prefill_budget=15, prefill_stall=None)
    prompts = [prompt_ids(1, n, seed=50 + n)[0].tolist() for n in (5, 6, 4, 37)]
    handles = [scheduler.submit(request(p, 10, f"s{i}"), None) for i, p in enumerate(prompts[:3])]
    for _ in range(2):
        scheduler.step()
    handles.append(scheduler.submit(request(prompts[3], 4, "long"), None))
    while scheduler.step():
        pass
    chunks = [c[2] for c in recording.calls if c[0] == "mixed"]
    assert chunks == [8, 8, 8, 8, 5]  # 15 - 3 decode tokens: bucket 8; the rest, padded
    assert runner.mixed_steps == {"captured": len(chunks), "eager": 0}
    for prompt, handle, new in zip(prompts, handles, (10, 10, 10, 4)):
        events = []
        while not handle.queue.empty():
            events.append(handle.queue.get_nowait())
        got = [e.token_id for e in events if isinstance(e, TokenEvent)]
        assert got == hf_greedy(ref, prompt, new)
    scheduler.stop(0)


def test_mixed_chunk_budget_counts_the_decode_tokens():
    """The per-step token budget: one token per decoding stream first, the rest to prompt
    chunks (at least MIN_PREFILL_CHUNK), in admission order."""
    from shardwise.serve.scheduler import split_step_budget

    assert split_step_budget(64, 3, [100]) == [61]
    assert split_step_budget(64, 3, [20, 100]) == [20, 41]
    assert split_step_budget(64, 3, [20, 41, 5]) == [20, 41]  # the budget is spent
    assert split_step_budget(64, 60, [100]) == [MIN_PREFILL_CHUNK]  # prompts still progress
    assert split_step_budget(64, 0, [3, 4]) == [3, 4]
    assert split_step_budget(10, 2, [5, 5]) == [5, 3]


@pytest.mark.gpu
@pytest.mark.parametrize("capturable", [True, False], ids=["cuda-graphs", "eager-mixed"])
@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_mixed_steps_on_cuda_give_each_sequence_its_hf_tokens(arch, capturable):
    """The same scenario on CUDA (fp32): the mixed steps replay the CUDA graphs warmup
    captured per chunk bucket (Triton's ``attention_chunks`` reads the spans on the device),
    or, with the chunk kernel declared not capturable, run eagerly through the CUDA backend's
    attention ops; the decode-only steps replay their graphs; nothing is captured after
    warmup."""
    ref = tiny_causal_lm(arch).cuda()
    engine = shardwise.init_inference(tiny_causal_lm(arch), device="cuda",
                                      replace_with_kernel_inject=True, enable_graph=True,
                                      dtype=torch.float32, max_tokens=64)
    for kernels in _chunk_kernels(engine):
        assert kernels.chunks_capturable and kernels.backends["attention_chunks"] == "triton"
        kernels.chunks_capturable = capturable
    runner = SlotRunner(engine, max_batch=5, max_tokens=40, mixed_buckets=(8, 16))
    try:
        assert runner.supports_mixed
        assert runner.mixed_buckets == ((8, 16) if capturable else ())
        runner.warmup()
        keys = set(runner.stack.graphs.graphs)
        check_against_hf(ref, mixed_scenario(runner), atol=1e-3)
        assert set(runner.stack.graphs.graphs) == keys  # nothing captured while serving
        assert runner.mixed_steps == ({"captured": 4, "eager": 0} if capturable else
                                      {"captured": 0, "eager": 4})
    finally:
        runner.close()


class _Shape:
    """Just what a Scheduler reads of a runner at construction, with mixed steps."""

    max_batch, max_tokens, vocab_size = 4, 64, 256
    supports_mixed, mixed_unsupported = True, None


def test_mixed_budget_is_cut_to_the_stall_allowance_by_the_chunks_measured_cost():
    """While streams decode, a mixed step's chunk takes what its cost beyond the decode step
    does in 0.75 of the typical step (62.5 ms: 46.875 ms), plus the decode tokens; never above
    prefill_budget. Before two mixed steps of different sizes the prefill calls' fit stands in
    (7.8125 ms + 0.9765625 ms a token: 40 tokens), then the mixed steps' (1.953125 ms a token:
    24 tokens). Binary fractions: the fits are exact."""
    scheduler = Scheduler(_Shape(), prefill_budget=512, prefill_worth=False, prefill_stall=0.75)
    assert scheduler.mixed
    assert scheduler._mixed_budget(3) == 512  # nothing measured yet: no cut
    scheduler._recent_steps.extend([1 / 16] * 5)
    scheduler._prefill_calls.extend([(16, 1 / 128 + 16 / 1024), (64, 1 / 128 + 64 / 1024)])
    assert scheduler._mixed_budget(3) == 3 + 40
    scheduler._mixed_calls.append((8, 8 / 512))
    assert scheduler._mixed_budget(3) == 3 + 40  # one size: no fit of its own yet
    scheduler._mixed_calls.append((32, 32 / 512))
    assert scheduler._mixed_budget(3) == 3 + 24
    assert scheduler._mixed_budget(500) == 512  # the budget caps decode + chunk tokens
    scheduler.prefill_stall = None
    assert scheduler._mixed_budget(3) == 512


def test_mixed_steps_on_an_offloaded_engine(tmp_path):
    """Weights streamed from disk (offload, 3 buffers): the mixed forward runs the same
    layers eagerly, so every sequence still gets its HF greedy tokens."""
    engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                      replace_with_kernel_inject=True, max_tokens=64,
                                      offload={"device": "nvme", "nvme_path": str(tmp_path),
                                               "buffer_count": 3})
    runner = SlotRunner(engine, max_batch=5, max_tokens=40)
    try:
        assert runner.supports_mixed
        check_against_hf(tiny_causal_lm("llama"), mixed_scenario(runner))
    finally:
        runner.close()
