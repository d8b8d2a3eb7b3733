"""Generation through shardwise: the embedded default model answers, ``shardwise generate``
matches plain HF greedy decoding, the engine keeps HF logits / ``generate`` / ``pipeline``
behaviour, and bad CLI input fails fast without loading a model."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import shardwise
import shardwise.models
from shardwise.cli import main
from shardwise.generation import TokenTimer, TokenTimings, timed_generate

from families import families
from models import prompt_ids, tiny_causal_lm, tiny_tokenizer

#: every registered family: the engine with no transform is HF's model (bert: HF's
#: BertLMHeadModel, what AutoModelForCausalLM builds of it)
ARCHS = sorted(families())
#: Max abs logit difference allowed between the engine and the plain HF model, per dtype. The
#: engine runs HF's own modules today, so both are expected to be exact; bf16 leaves room for
#: about 4 ulps at |logit| ~ 1 for when fused kernels are injected.
LOGIT_ATOL = {torch.float32: 1e-6, torch.bfloat16: 3e-2}
TIMING_LINE = re.compile(r"prefill [\d.]+ ms \| decode [\d.]+ ms/token \(median of \d+\) "
                         r"\| [\d.]+ tokens/s")


def greedy(model, input_ids: torch.Tensor, new_tokens: int = 16) -> torch.Tensor:
    return model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                          max_new_tokens=new_tokens, do_sample=False)


# ----- the embedded default model -------------------------------------------------------------

@pytest.fixture(scope="module")
def default_model():
    """The embedded SmolLM2 and its tokenizer, loaded once for this module (~20 s)."""
    return shardwise.models.load_model(None)


def ask_capital_of_france(engine, tokenizer) -> tuple[str, torch.Tensor]:
    """The engine's greedy answer to the chat question (at most 16 new tokens): (text, the new
    token ids [1, n])."""
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=True,
                                           return_tensors="pt").to(engine.device)
    output = engine.module.generate(**inputs, max_new_tokens=16, do_sample=False)
    new = output[:, inputs["input_ids"].shape[1]:]
    return tokenizer.decode(new[0], skip_special_tokens=True), new


@pytest.fixture(scope="module")
def plain_answer(default_model):
    """The embedded model's answer through ``init_inference`` with no transform: HF's own
    greedy tokens, which the transformed runs below are held to."""
    model, tokenizer = default_model
    return ask_capital_of_france(shardwise.init_inference(model, device="cpu"), tokenizer)


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france(plain_answer):
    answer, _ = plain_answer
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_default_model_answers_through_injection_and_graphs(default_model, plain_answer,
                                                            monkeypatch):
    """Injected kernels with every decode step a compiled graph (fp32): the same tokens as HF."""
    from shardwise.inject import InjectedModel
    from shardwise.inject.injector import injected_stack

    model, tokenizer = copy.deepcopy(default_model[0]), default_model[1]
    engine = shardwise.init_inference(model, device="cpu", replace_with_kernel_inject=True,
                                      enable_graph=True)
    stack = injected_stack(model)
    assert isinstance(stack, InjectedModel) and stack.graphs.strategy.accelerates
    steps = []  # each decode step run by a graph (instance-scoped patch)
    run = stack.graphs.run
    monkeypatch.setattr(stack.graphs, "run", lambda *a, **kw: steps.append(1) or run(*a, **kw))
    answer, tokens = ask_capital_of_france(engine, tokenizer)
    assert "Paris" in answer, answer
    assert torch.equal(tokens, plain_answer[1]), (answer, plain_answer[0])
    assert len(steps) == tokens.shape[1] - 1  # every token after the prompt's came from a graph
    assert stack.graphs.buckets() == {1}


@pytest.mark.slow
def test_default_model_answers_with_int8_weights(default_model):
    """8-bit weights under injected kernels, computing in bf16 (the CPU's int8 compute dtype:
    about 3x faster to set up and run here than fp32 compute, measured under load)."""
    from shardwise.quant import QuantLinear

    model, tokenizer = copy.deepcopy(default_model[0]), default_model[1]
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.bfloat16,
                                      replace_with_kernel_inject=True,
                                      quant={"weight": {"num_bits": 8}})
    quantized = sum(isinstance(m, QuantLinear) for m in model.modules())
    assert engine.quantization.layers_quantized == quantized >= 7 * model.config.num_hidden_layers
    answer, _ = ask_capital_of_france(engine, tokenizer)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_cli_default_model_answers_and_reports_latency(default_model, monkeypatch, capsys):
    # load_model itself is exercised by the fixture; reuse its model instead of loading again.
    calls = []
    monkeypatch.setattr(shardwise.models, "load_model",
                        lambda path, dtype=None: calls.append((path, dtype)) or default_model)
    assert main(["generate", "--max-new-tokens", "12"]) == 0
    out, err = capsys.readouterr()
    assert calls == [(None, None)]
    assert "Paris" in out, out
    assert TIMING_LINE.search(err), err


# ----- a tiny saved Llama through the CLI -------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A tiny Llama and the tiny tokenizer saved with save_pretrained."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_causal_lm("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def hf_greedy_new_ids(path, prompt: str, new_tokens: int) -> list[int]:
    """Plain HF greedy decoding of ``prompt`` with the model saved at ``path``."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = transformers.AutoTokenizer.from_pretrained(path)(prompt, return_tensors="pt").input_ids
    return greedy(model, ids, new_tokens)[0, ids.shape[1]:].tolist()


def test_cli_tokens_equal_hf_greedy(tiny_llama_dir, capsys):
    prompt = "t5 t9 t13 t200"
    assert main(["generate", "--model", str(tiny_llama_dir), "--device", "cpu",
                 "--max-new-tokens", "16", "--json", prompt]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = hf_greedy_new_ids(tiny_llama_dir, prompt, 16)
    assert len(expected) > 1
    assert result["token_ids"] == expected
    assert result["text"] == tiny_tokenizer().decode(expected, skip_special_tokens=True)
    assert (result["device"], result["dtype"]) == ("cpu", "float32")
    assert len(result["timings"]["per_token_s"]) == len(expected) - 1


def test_cli_text_mode_prints_text_and_timing(tiny_llama_dir, capsys):
    prompt = "t7 t8"
    assert main(["generate", "--model", str(tiny_llama_dir), "--dtype", "bf16",
                 "--max-new-tokens", "6", prompt]) == 0
    out, err = capsys.readouterr()
    words = out.split()
    assert 1 <= len(words) <= 6 and all(re.fullmatch(r"t\d+", w) for w in words), out
    assert TIMING_LINE.search(err) and err.rstrip().endswith("cpu bfloat16"), err


def test_cli_reads_prompt_file(tiny_llama_dir, tmp_path, capsys):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("t5 t9 t13 t200\n")
    assert main(["generate", "--model", str(tiny_llama_dir), "--max-new-tokens", "4", "--json",
                 "--prompt-file", str(prompt_file)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["token_ids"] == hf_greedy_new_ids(tiny_llama_dir, "t5 t9 t13 t200", 4)


def test_cli_model_without_tokenizer_exits_2(tmp_path, capsys):
    tiny_causal_lm("llama").save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "t5"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err


# ----- engine parity with the plain HF model ----------------------------------------------------

def engine_and_reference(arch: str, dtype: torch.dtype):
    """(engine over a tiny model, the same weights as a plain HF model cast by HF to ``dtype``)."""
    engine = shardwise.init_inference(tiny_causal_lm(arch), device="cpu", dtype=dtype)
    return engine, tiny_causal_lm(arch).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_logits_match_hf(arch, dtype):
    engine, reference = engine_and_reference(arch, dtype)
    ids = prompt_ids(batch=2, length=12)
    got = engine(ids).logits
    with torch.inference_mode():
        want = reference(ids).logits
    assert got.dtype == want.dtype == dtype
    assert (got.float() - want.float()).abs().max().item() <= LOGIT_ATOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_tokens_match_hf(arch, dtype):
    engine, reference = engine_and_reference(arch, dtype)
    ids = prompt_ids(length=8)
    got = greedy(engine.module, ids)
    want = greedy(reference, ids)
    assert got.shape[1] > ids.shape[1]
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ARCHS)
def test_pipeline_over_engine_module(arch):
    engine, reference = engine_and_reference(arch, torch.float32)
    tokenizer = tiny_tokenizer()
    kwargs = dict(max_new_tokens=8, do_sample=False)
    prompt = "t5 t9 t13"
    got = transformers.pipeline("text-generation", model=engine.module,
                                tokenizer=tokenizer)(prompt, **kwargs)[0]["generated_text"]
    want = transformers.pipeline("text-generation", model=reference,
                                 tokenizer=tokenizer)(prompt, **kwargs)[0]["generated_text"]
    assert got.startswith(prompt) and len(got) > len(prompt)
    assert got == want


# ----- timing ---------------------------------------------------------------------------------

def test_token_timings_statistics():
    timings = TokenTimings(prefill_s=0.5, per_token_s=[0.1, 0.3, 0.2, 0.2], batch_size=2)
    assert timings.new_tokens == 5
    assert timings.median_s == pytest.approx(0.2)
    assert timings.tokens_per_s == pytest.approx(8 / 0.8)
    single = TokenTimings(prefill_s=0.5)
    assert single.median_s is None and single.tokens_per_s is None
    assert "n/a" in single.summary()


def test_token_timer_gaps(monkeypatch):
    clock = iter([10.0, 10.5, 10.7, 11.0])
    monkeypatch.setattr("shardwise.generation.time.perf_counter", lambda: next(clock))
    timer = TokenTimer()
    timer.put(torch.zeros(3, 4, dtype=torch.long))  # the prompt, batch 3
    for _ in range(3):
        timer.put(torch.zeros(3, dtype=torch.long))
    timings = timer.timings()
    assert timings.prefill_s == pytest.approx(0.5)
    assert timings.per_token_s == pytest.approx([0.2, 0.3])
    assert timings.batch_size == 3


def test_timed_generate_times_every_new_token():
    model = tiny_causal_lm("gpt2")
    ids = prompt_ids(length=6)
    output, timings = timed_generate(model, {"input_ids": ids}, max_new_tokens=5,
                                     do_sample=False, min_new_tokens=5)
    assert output.shape[1] - ids.shape[1] == timings.new_tokens == 5
    assert timings.prefill_s > 0 and all(t > 0 for t in timings.per_token_s)


# ----- bad input fails fast ---------------------------------------------------------------------

@pytest.fixture
def no_model_loading(monkeypatch):
    """Make loading a model an error, to prove the CLI rejected its input before loading."""
    def refuse(*args, **kwargs):
        raise AssertionError("load_model was called for input the CLI should have rejected")
    monkeypatch.setattr(shardwise.models, "load_model", refuse)


def bad_inputs(tmp_path):
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"\0")
    return {
        "missing path": (["--model", str(tmp_path / "nope")], "does not exist"),
        "dir without config.json": (["--model", str(tmp_path / "empty_dir")], "no config.json"),
        "not gguf": (["--model", str(tmp_path / "weights.bin")], "not a .gguf file"),
        "unknown device": (["--device", "nosuchdevice"], "unknown device 'nosuchdevice'"),
        "fp16 on cpu": (["--device", "cpu", "--dtype", "fp16"], "cannot run dtype float16"),
        "unparseable dtype": (["--dtype", "fp7"], "dtype 'fp7' is not understood"),
        "temperature without --sample": (["--temperature", "0.7"], "--sample"),
        "missing prompt file": (["--prompt-file", str(tmp_path / "none.txt")], "--prompt-file"),
        "empty prompt": ([" "], "prompt is empty"),
    }


@pytest.mark.parametrize("case", ["missing path", "dir without config.json", "not gguf",
                                  "unknown device", "fp16 on cpu", "unparseable dtype",
                                  "temperature without --sample", "missing prompt file",
                                  "empty prompt"])
def test_bad_input_exits_2_without_loading(case, tmp_path, no_model_loading, capsys):
    argv, message = bad_inputs(tmp_path)[case]
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardwise: error: ") and message in err, err
