"""``shardwise bench``: statistics, roofline arithmetic, figures, JSON schema, comparison, bad
input, failure capture, and small end-to-end runs on tiny presets."""

from __future__ import annotations

import dataclasses
import copy
import json
import sys

import pytest
import torch

import shardwise.bench.runner as runner
import shardwise.bench.session as session
from shardwise.accelerators.cpu import CpuAccelerator
from shardwise.bench import chart, launch, report, roofline, stats
from shardwise.bench.compare import compare, format_compare
from shardwise.bench.figures import add_figures, figures
from shardwise.bench.plan import (Cell, ModelSpec, Plan, Variant, check_tp, default_variants,
                                  dtype_name, world_size)
from shardwise.bench.presets import PRESETS, count_parameters, get_preset
from shardwise.cli import build_parser, main
from shardwise.errors import ConfigError

from models import tiny_causal_lm

TINY = "llama-2l-64h-gqa"
FAST = ["--bandwidth-mib", "8", "--no-progress", "--warmup", "1", "--repeats", "2",
        "--prompt-len", "8", "--new-tokens", "4"]


# ----- statistics ---------------------------------------------------------------------------------

def test_percentile_interpolates_between_order_statistics():
    samples = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert stats.median(samples) == 2.5
    assert stats.percentile(samples, 90) == pytest.approx(3.7)
    assert stats.percentile(samples, 0) == 1.0 and stats.percentile(samples, 100) == 4.0
    assert stats.percentile([7.0], 90) == 7.0
    assert stats.median([1.0, 2.0, 100.0]) == 2.0


def test_percentile_rejects_empty_and_out_of_range():
    with pytest.raises(ValueError):
        stats.percentile([], 50)
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)


def test_summarize_and_ratio():
    s = stats.summarize([1.0, 2.0, 3.0, 4.0, 5.0])
    assert s == {"median": 3.0, "p90": pytest.approx(4.6), "min": 1.0, "max": 5.0, "n": 5}
    assert stats.summarize([]) == {"n": 0}
    assert stats.ratio(6.0, 3.0) == 2.0
    assert stats.ratio(1.0, 0.0) is None and stats.ratio(None, 2.0) is None


# ----- roofline -------------------------------------------------------------------------------------

def test_roofline_arithmetic_on_known_numbers():
    assert roofline.copy_gbps(10**9, 1.0) == 2.0  # read + write
    assert roofline.decode_gbps(2 * 10**9, 0.01) == pytest.approx(200.0)
    assert roofline.bandwidth_pct(50.0, 200.0) == 25.0
    # 2 FLOPs × 1e9 params × (32 tokens × batch 2) / 0.5 s = 256 TFLOP/s... / 1e12
    assert roofline.prefill_tflops(10**9, 32, 2, 0.5) == pytest.approx(0.256)


def test_weight_bytes_counts_tied_embeddings_once():
    model = tiny_causal_lm("gpt2")  # ties lm_head to the token embeddings
    assert model.lm_head.weight is model.transformer.wte.weight
    every = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    unique = every - model.lm_head.weight.numel()
    assert roofline.weight_bytes(model) == unique * 4
    assert roofline.weight_bytes(model.to(torch.bfloat16)) == unique * 2


def test_nonembedding_parameters_exclude_embeddings_and_head():
    model = tiny_causal_lm("llama")  # untied: embed 256×64 and lm_head 256×64
    total = sum(p.numel() for p in model.parameters())
    assert roofline.nonembedding_parameters(model) == total - 2 * 256 * 64
    gpt2 = tiny_causal_lm("gpt2")  # tied token table plus a 256×64 position table
    total = sum(p.numel() for p in gpt2.parameters())
    assert roofline.nonembedding_parameters(gpt2) == total - 256 * 64 - 256 * 64


def test_measure_bandwidth_on_cpu():
    bw = roofline.measure_bandwidth(CpuAccelerator(), 4 << 20, repeats=3)
    assert len(bw.samples_s) == 3 and bw.gbps > 0
    d = bw.to_dict()
    assert d["bytes_moved_per_copy"] == 2 * d["bytes"] == 8 << 20
    assert d["gbps"] == pytest.approx(roofline.copy_gbps(4 << 20, stats.median(bw.samples_s)))
    later = roofline.Bandwidth(4 << 20, [[1e-3, 2e-3, 3e-3]])  # 8.4 GB/s: slower
    both = bw.add(later)
    assert both.probe_gbps == [bw.gbps, pytest.approx(roofline.copy_gbps(4 << 20, 2e-3))]
    assert both.gbps == max(bw.gbps, later.gbps) and len(both.samples_s) == 6
    with pytest.raises(ValueError, match="bytes"):
        bw.add(roofline.Bandwidth(8 << 20, [[1e-3]]))


# ----- timing --------------------------------------------------------------------------------------

class CountingCpu(CpuAccelerator):
    syncs = 0

    def synchronize(self):
        type(self).syncs += 1


def test_each_token_is_timed_after_synchronizing_through_the_accelerator():
    model = tiny_causal_lm("llama")
    inputs = runner.make_inputs(None, 256, Cell(2, 5, 4))
    acc = CountingCpu()
    sample = runner.time_generate(model, inputs, runner.generation_kwargs(model, 4), 4, acc)
    assert len(sample["per_token_s"]) == 3 and sample["prefill_s"] > 0
    assert CountingCpu.syncs == 1 + 1 + 4  # before generate, the prompt, each new token
    with pytest.raises(RuntimeError, match="produced 4 tokens, not 5"):
        runner.time_generate(model, inputs, runner.generation_kwargs(model, 4), 5, acc)


def test_prompt_is_the_text_repeated_and_cut_to_length_each_row_shifted():
    def tokenizer(text, add_special_tokens):
        assert text == runner.PROMPT_TEXT and not add_special_tokens
        return {"input_ids": [5, 6, 7]}

    inputs = runner.make_inputs(tokenizer, 100, Cell(2, 7, 1))
    assert inputs["input_ids"].tolist() == [[5, 6, 7, 5, 6, 7, 5], [6, 7, 5, 6, 7, 5, 6]]
    assert inputs["attention_mask"].sum() == 14
    random_ids = runner.make_inputs(None, 100, Cell(1, 50, 1), seed=3)["input_ids"]
    assert torch.equal(random_ids, runner.make_inputs(None, 100, Cell(1, 50, 1), seed=3)[
        "input_ids"]) and int(random_ids.max()) < 100
    rows = runner.make_inputs(None, 100, Cell(2, 50, 1))["input_ids"]
    assert not torch.equal(rows[0], rows[1])  # an MoE model routes different rows differently


# ----- figures ----------------------------------------------------------------------------------------

def _record(variant="hf", prefill=(0.2, 0.1, 0.3), step=0.01, status="ok", **extra):
    rec = runner.record(ModelSpec("preset", "m"), variant, Cell(2, 16, 3), status=status,
                        weight_bytes=10**9, nonembedding_params=10**8, peak_memory_bytes=2**30)
    rec["samples"]["warmup"] = [{"prefill_s": 9.0, "per_token_s": [9.0, 9.0]}]
    rec["samples"]["repeats"] = [{"prefill_s": p, "per_token_s": [step, 2 * step]}
                                 for p in prefill]
    rec.update(extra)
    return rec


def test_figures_from_known_samples():
    f = figures(_record(), device_gbps=200.0)
    assert f["prefill_ms"]["median"] == pytest.approx(200.0)  # warm-up (9 s) is ignored
    assert f["decode_ms"]["median"] == pytest.approx(15.0)  # pooled [10, 20] × 3
    assert f["decode_ms"]["p90"] == pytest.approx(20.0)
    assert f["tokens_per_s"] == pytest.approx(2 / 0.015)  # batch 2
    assert f["decode_gbps"] == pytest.approx(1e9 / 0.015 / 1e9)
    assert f["bandwidth_pct"] == pytest.approx(100 * (1 / 0.015) / 200)
    assert f["prefill_tflops"] == pytest.approx(2 * 1e8 * 16 * 2 / 0.2 / 1e12)
    assert f["e2e_tokens_per_s"] == pytest.approx(2 * 3 / (0.2 + 0.03))


def test_speedup_is_baseline_latency_over_variant_latency():
    runs = add_figures([_record(), _record("shardwise", prefill=(0.1, 0.1, 0.1), step=0.005),
                        _record("shardwise[int8]", status="failed", error="boom")], 100.0)
    assert runs[0]["figures"]["speedup"]["decode"] == 1.0
    assert runs[1]["figures"]["speedup"] == {"decode": pytest.approx(2.0),
                                             "prefill": pytest.approx(2.0),
                                             "e2e": pytest.approx(0.23 / 0.115)}
    assert runs[2]["figures"] == {}


# ----- JSON, table, comparison --------------------------------------------------------------------

def _document(scale: float = 1.0, runs=None):
    runs = runs if runs is not None else [
        _record(), _record("shardwise", prefill=(0.1,) * 3, step=0.005 * scale)]
    return report.build_document("shardwise bench", report.provenance(CpuAccelerator(), {}),
                                 {}, {"gbps": 100.0, "bytes": 2**20}, add_figures(runs, 100.0))


def test_provenance_has_device_versions_revision_and_date():
    prov = report.provenance(CpuAccelerator(), {"tp": 1})
    assert set(report.PROVENANCE_KEYS) <= set(prov)
    assert prov["device"] == "cpu" and prov["device_name"]
    assert set(prov["versions"]) == {"shardwise", "torch", "transformers", "python"}
    assert prov["versions"]["torch"] == torch.__version__
    assert prov["options"] == {"tp": 1} and prov["date"][:2] == "20"


def test_check_document_names_what_is_missing(tmp_path):
    doc = _document()
    assert report.check_document(copy.deepcopy(doc)) == doc
    del doc["runs"][0]["samples"]
    with pytest.raises(ConfigError, match=r"runs\[0\]\.samples"):
        report.check_document(doc)
    with pytest.raises(ConfigError, match="not a shardwise bench result"):
        report.check_document({"schema": "other"})
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        report.read_json(tmp_path / "bad.json")


def test_table_marks_failures_with_their_error():
    doc = _document(runs=[_record(), _record("shardwise", status="failed", error="Boom: no")])
    text = report.format_table(doc)
    assert "FAILED [1]" in text and "[1] Boom: no" in text
    assert "1.00x" in text  # the baseline's speed-up over itself


def test_compare_ratios_between_two_saved_runs(tmp_path, capsys):
    a, b = _document(1.0), _document(2.0)  # b's shardwise decode steps take twice as long
    b["runs"] += add_figures([_record("shardwise[int8]")], 100.0)
    rows = {r["key"][1]: r for r in compare(a, b)}
    assert rows["hf"]["ratio"]["ms/tok"] == pytest.approx(1.0)
    assert rows["shardwise"]["ratio"]["ms/tok"] == pytest.approx(2.0)
    assert rows["shardwise"]["ratio"]["tok/s"] == pytest.approx(0.5)
    assert rows["shardwise[int8]"]["only_in"] == "b"
    report.write_json(a, tmp_path / "a.json")
    report.write_json(b, tmp_path / "b.json")
    assert main(["bench", "--compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "(2.00x)" in out and "(0.50x)" in out and "only in" in out
    assert "2.00x" in format_compare(a, b)
    c = copy.deepcopy(b)
    c["runs"][1]["dtype"] = "bfloat16"  # the same variant in another dtype is another run
    rows = {(r["key"][1], r["key"][-1]): r for r in compare(a, c)}
    assert rows["shardwise", None]["only_in"] == "a"
    assert rows["shardwise", "bfloat16"]["only_in"] == "b"


# ----- bad input (fixture no_heavy_work: tests/conftest.py) ------------------------------------------


def test_unknown_preset_lists_the_presets(no_heavy_work, capsys):
    assert main(["bench", "--preset", "gpt-5"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'gpt-5'" in err
    assert all(name in err for name in PRESETS)


def test_model_dir_without_config_json(no_heavy_work, tmp_path, capsys):
    assert main(["bench", "--model", str(tmp_path)]) == 2
    assert "has no config.json" in capsys.readouterr().err


def test_tp_beyond_the_devices_fails_before_any_model(no_heavy_work, capsys):
    too_many = CpuAccelerator().max_ranks_per_node() + 1
    assert main(["bench", "--preset", TINY, "--tp", str(too_many)]) == 2
    err = capsys.readouterr().err
    assert f"--tp {too_many}" in err and "at most" in err
    with pytest.raises(ConfigError, match="at most 6"):
        check_tp(type("Acc", (CpuAccelerator,), {"max_ranks_per_node": lambda s: 3})(), 7, 2)
    assert check_tp(type("Acc", (CpuAccelerator,), {"max_ranks_per_node": lambda s: 3})(),
                    6, 2) == 3


def test_dtype_the_device_cannot_run_is_its_own_error(no_heavy_work, capsys):
    assert main(["bench", "--preset", TINY, "--dtype", "fp16"]) == 2
    assert "cannot run dtype float16" in capsys.readouterr().err


def test_presets_are_named_by_shape_and_cover_the_required_shapes():
    assert get_preset("LLAMA-2L-64H-GQA").name == TINY
    gqa = [p for p in PRESETS.values() if p.config.get("num_key_value_heads", 0) > 0
           and p.config["num_key_value_heads"] < p.config["num_attention_heads"]]
    sizes = sorted(count_parameters(p.name) for p in gqa)
    assert any(0.4e9 < s < 0.7e9 for s in sizes) and any(0.9e9 < s < 1.3e9 for s in sizes)
    assert {p.config_class for p in PRESETS.values()} >= {"GPT2Config", "OPTConfig"}
    assert not any(word in name for name in PRESETS for word in ("smol", "tinyllama", "qwen"))


@pytest.mark.parametrize("argv, says", [
    (["--graphs"], "--graphs captures the injected decode step: add --inject"),
    (["--graphs", "--quant", "int8"], "add --inject"),
    (["--plain", "--inject"], "--plain is the variant without optimising options"),
    (["--quant-head"], "--quant-head quantizes the head with --quant's format: add --quant"),
    (["--master-port", "29999"], "--master-port need --nnodes > 1"),
    (["--nnodes", "2", "--tp", "2", "--node-rank", "2"], "--node-rank 2 is not in 0..1"),
    (["--prompt-len", "500", "--new-tokens", "20"], "exceed the 512 positions of " + TINY),
    (["--output", "r.png"], "must end in .json"),
    (["--list-presets", "--inject"], "--list-presets takes no other option; drop --preset, --inject"),
    (["--compare", "a.json", "b.json"], "--compare takes no other option; drop --preset"),
])
def test_invalid_combinations_fail_in_one_line_before_anything_runs(no_heavy_work, capsys,
                                                                     argv, says):
    assert main(["bench", "--preset", TINY, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err, err


def test_unwritable_output_is_found_before_the_runs(no_heavy_work, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    unwritable = [tmp_path / "missing" / "r.json", tmp_path / "a-file" / "r.json",
                  tmp_path]  # a folder, not a file
    if sys.platform.startswith("linux"):
        unwritable.append("/proc/shardwise-bench.json")  # read-only even for root
    for output in unwritable:
        assert main(["bench", "--preset", TINY, "--output", str(output)]) == 2, output
        assert "--output" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [tmp_path / "a-file"]  # the check left nothing behind
    assert report.check_writable(tmp_path / "r.json") == tmp_path / "r.json"
    assert list(tmp_path.iterdir()) == [tmp_path / "a-file"]


# ----- the default variants -----------------------------------------------------------------------


def _default_plan(argv=()):
    from shardwise.cli.bench import _plan as cli_plan

    return cli_plan(build_parser().parse_args(["bench", "--preset", TINY, *argv]))


def test_default_run_is_injection_with_graphs_int8_and_int4_as_the_device_says():
    from shardwise.kernel_registry import REFERENCE, registry

    acc = CpuAccelerator()
    plan, _, _, notes = _default_plan()
    preferred = dtype_name(acc.preferred_dtype)
    assert plan.variant_names == ["shardwise[inject,graphs]", "shardwise[inject,graphs,int8]",
                                  "shardwise[inject,graphs,int4]"] and notes == []
    assert plan.variants[0].dtype == preferred == plan.baseline_dtype  # HF in the same dtype
    for variant, bits in zip(plan.variants[1:], (8, 4)):  # each in a dtype with a fast kernel
        group = 128 if bits == 4 else 1024
        impl = registry.resolve("quant_linear", acc, getattr(torch, variant.dtype), bits=bits,
                                group_size=group, symmetric=True, in_features=1024,
                                out_features=1024)
        assert impl.backend != REFERENCE
    # any variant option means the one variant it describes
    plan, *_ = _default_plan(["--dtype", "fp32"])
    assert plan.variants == [Variant("float32")] and plan.baseline_dtype == "float32"
    plan, *_ = _default_plan(["--quant", "int4", "--quant-head"])
    assert plan.variant_names == ["shardwise[int4,head]"]
    assert plan.variants[0].engine_options()["quant"] == {"weight": {"num_bits": 4},
                                                          "lm_head": True}
    plan, *_ = _default_plan(["--dtype", "fp32", "--inject", "--graphs", "--weight-dtype",
                              "fp16"])
    assert plan.variant_names == ["shardwise[inject,graphs,fp16-weights]"]
    assert plan.variants[0].engine_options()["weight_dtype"] == "fp16"
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_hf_loop_times_hfs_generate_around_the_injected_variants():
    """--hf-loop: the injected variants (the default set's, or the one described) time HF's
    loop (tag hf-loop); a variant without injection has no loop of shardwise's to replace."""
    plan, *_ = _default_plan(["--hf-loop"])
    assert [v.hf_loop for v in plan.variants] == [True, True, True]
    assert all(name.endswith(",hf-loop]") for name in plan.variant_names)
    plan, *_ = _default_plan(["--dtype", "fp32", "--hf-loop"])
    assert plan.variants == [Variant("float32")]


def test_default_variants_ask_the_accelerator_not_the_device_name():
    from shardwise.accelerator import GraphStrategy

    class Plain(CpuAccelerator):  # no graph strategy that accelerates, no kernel backend
        kernel_backends = ()

        def graph_strategy(self):
            return GraphStrategy()

    variants, notes = default_variants(Plain())
    assert variants == [Variant(dtype_name(Plain().preferred_dtype), inject=True)]
    assert [n.split(":")[0] for n in notes] == ["no int8 row", "no int4 row"]
    assert all("fast" in n and "quant_linear" in n for n in notes)


def test_loading_shows_no_progress_bar_of_its_own(monkeypatch, capsys):
    """transformers' GGUF converter calls tqdm itself; inside the bench it stays silent, so
    the bench's bar is the one display."""
    import shardwise.models
    from transformers import modeling_gguf_pytorch_utils as gguf
    from transformers.utils import logging as hf_logging

    def fake_load_model(path, dtype):
        for _ in gguf.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        assert not hf_logging.is_progress_bar_enabled()
        return tiny_causal_lm("llama"), None

    monkeypatch.setattr(shardwise.models, "load_model", fake_load_model)
    before = gguf.tqdm
    runner.load(ModelSpec("path", "m.gguf", "m.gguf"), None, 0)
    assert "Converting" not in capsys.readouterr().err
    assert gguf.tqdm is before and hf_logging.is_progress_bar_enabled()


def test_the_bar_is_the_one_display_on_a_terminal(monkeypatch):
    """On a terminal, the graph capture's own progress line would draw a second display under
    the bench's bar: inside the bar, stderr is not a terminal, so it takes its logged form, and
    whatever else is written to stderr comes out above the bar, line by line."""
    import io

    from shardwise.graphs import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with session.one_display(2) as bar:
        assert not sys.stderr.isatty()
        with progress("capturing the decode step for batch bucket 1"):
            assert bar.postfix == "capturing the decode step for batch bucket 1"  # in the bar
            bar.update(1)
        assert not bar.postfix  # until it is done
        sys.stderr.write("compiler: step 1\rcompiler: step 2\n")
        print("a line from a library", file=sys.stderr)
        sys.stderr.write("unfinished")
    shown = terminal.getvalue()
    assert "shardwise: capturing the decode step" not in shown  # no line of its own
    assert "compiler: step 2\n" in shown and "compiler: step 1" not in shown
    assert "a line from a library\n" in shown and "unfinished\n" in shown
    assert sys.stderr is terminal


def test_default_variants_end_to_end_on_a_tiny_preset(tmp_path, capsys, monkeypatch):
    """The default set (graph capture off here to keep the test fast: the graph strategy is
    eager, so the default asks for injection alone): one model load, every variant on its own
    copy, each row with its speed-up and bandwidth share."""
    monkeypatch.setenv("SHARDWISE_CPU_GRAPHS", "eager")
    out = tmp_path / "run.json"
    assert main(["bench", "--preset", TINY, *FAST, "--output", str(out)]) == 0
    doc = report.read_json(out)
    runs = doc["runs"]
    assert [(r["variant"], r["status"]) for r in runs] == [
        ("hf", "ok"), ("shardwise[inject]", "ok"), ("shardwise[inject,int8]", "ok"),
        ("shardwise[inject,int4]", "ok")]
    hf, full, int8, int4 = runs
    assert int4["weight_bytes"] < int8["weight_bytes"] < full["weight_bytes"] \
        == hf["weight_bytes"]  # each quantized its own copy; the baseline stayed whole
    for rec in runs:
        assert rec["figures"]["speedup"]["decode"] > 0 and rec["figures"]["bandwidth_pct"] > 0
        assert rec["dtype"] == dtype_name(CpuAccelerator().preferred_dtype)
    table = capsys.readouterr().out
    assert "dtype" in table and "shardwise[inject,int4]" in table
    if chart.plotting_available():
        assert out.with_suffix(".png").stat().st_size > 1000


# ----- MoE: presets, HF's experts implementations, bytes read per step ----------------------------

MOE_TINY = "mixtral-2l-64h-4e"


def test_moe_presets_mixtral_about_1b_and_fine_grained_with_a_shared_expert():
    mixtral, fine = get_preset("mixtral-18l-1024h-8e"), get_preset("moe-shared-12l-1024h-64e")
    assert 0.9e9 < count_parameters(mixtral.name) < 1.1e9
    assert (mixtral.config["num_local_experts"], mixtral.config["num_experts_per_tok"]) == (8, 2)
    assert (fine.config["num_experts"], fine.config["num_experts_per_tok"]) == (64, 6)
    assert fine.config_class == "Qwen2MoeConfig" and fine.config["shared_expert_intermediate_size"]
    tiny = get_preset("moe-shared-2l-64h-8e")  # its tiny twin, for tests and smoke runs
    assert tiny.config_class == fine.config_class and tiny.config["num_experts"] == 8
    assert tiny.config["shared_expert_intermediate_size"] and count_parameters(tiny.name) < 1e6


def _tiny_mixtral():
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, vocab_size=64, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config).eval()


def _unread_rows(tokens: int) -> int:
    """The tiny Mixtral's untied input embedding (vocab 64 × hidden 32, fp32) less the rows a
    step of ``tokens`` rows looks up."""
    return (64 - tokens) * 32 * 4


def test_decode_bytes_count_only_the_looked_up_rows_of_an_untied_input_embedding():
    from transformers import GPT2Config, GPT2LMHeadModel

    untied = _tiny_mixtral()
    assert roofline.unread_embedding_bytes(untied, 3) == _unread_rows(3)
    # GPT-2: the token table is the head's weight (read whole by the head); the position table
    # (n_positions 16 × 32) is looked up
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64,
                                      n_positions=16)).eval()
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert roofline.unread_embedding_bytes(gpt2, 2) == (16 - 2) * 32 * 4
    assert roofline.moe_decode_bytes(gpt2, None, 2) == (
        roofline.weight_bytes(gpt2) - (16 - 2) * 32 * 4, roofline.READ_WEIGHTS)
    assert roofline.unread_embedding_bytes(gpt2, 100) == 0  # never negative


def test_moe_decode_bytes_are_the_dense_parts_and_the_experts_routed_to():
    model = _tiny_mixtral()
    one_expert = (2 * 48 * 32 + 32 * 48) * 4  # gate_up (2·inter × hidden) + down, fp32
    per_layer = (32 * 32 + 2 * 32 * 16 + 32 * 32  # q, k, v (2 kv heads × 8), o
                 + 2 * 32 + 4 * 32)  # two RMSNorms, the router
    dense = (64 * 32 * 2 + 32 + 2 * per_layer) * 4  # embeddings, head, final norm, 2 layers
    assert roofline.weight_bytes(model) == dense + 2 * 4 * one_expert
    layers = roofline.expert_modules(model)
    assert len(layers) == 2 and roofline.expert_bytes(layers[0]) == 4 * one_expert
    hidden = torch.randn(2, 32)
    with roofline.RoutingCounter(model) as counter:
        for generate in range(2):  # each generate: one prefill call per module, not counted
            counter.next_generate()
            for layer in layers:
                layer(torch.randn(5, 32), torch.tensor([[2, 3]] * 5), torch.ones(5, 2))
            for first, second in (([[0, 1], [1, 2]], [[0, 3], [3, 0]]),  # 3 and 2 distinct
                                  ([[0, 1], [0, 1]], [[1, 2], [2, 3]])):  # 2 and 3 distinct
                layers[0](hidden, torch.tensor(first), torch.ones(2, 2))
                layers[1](hidden, torch.tensor(second), torch.ones(2, 2))
    assert [len(seen) for seen in counter.routings] == [4, 4]  # 2 decode steps × 2 generates
    assert counter.mean_distinct() == [2.5, 2.5]
    assert roofline.moe_decode_bytes(model, counter, 2) == (
        dense - _unread_rows(2) + 5 * one_expert, "dense + routed experts (measured)")
    # no count: uniform routing; one token reads exactly top_k experts per layer
    assert roofline.moe_decode_bytes(model, None, 1) == (
        dense - _unread_rows(1) + 2 * 2 * one_expert, "dense + routed experts (expected)")
    assert roofline.expected_distinct_experts(64, 6, 1) == pytest.approx(6)
    assert roofline.expected_distinct_experts(8, 2, 8) == pytest.approx(8 * (1 - 0.75 ** 8))
    assert roofline.moe_decode_bytes(tiny_causal_lm(), None, 1)[1] == roofline.READ_WEIGHTS


@pytest.mark.parametrize("argv, says", [
    (["--preset", TINY, "--baseline-experts", "eager"], f"and {TINY} is a dense model"),
    (["--baseline-experts", "eager"], "needs an MoE model"),  # the embedded GGUF default
    (["--preset", MOE_TINY, "--baseline-experts", "fastest"], "choose one of eager, "),
    (["--preset", MOE_TINY, "--plain", "--baseline-experts", "sonicmoe"],
     "--baseline-experts sonicmoe does not run on 'cpu' in float32 (ImportError"),
])
def test_baseline_experts_is_refused_before_any_load(no_heavy_work, capsys, argv, says):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err, err


def test_moe_baseline_runs_the_chosen_experts_implementation_and_counts_routed_bytes(
        tmp_path, capsys):
    out = tmp_path / "moe.json"
    assert main(["bench", "--preset", MOE_TINY, "--plain", "--batch", "2",
                 "--baseline-experts", "eager", *FAST, "--no-chart", "--output", str(out)]) == 0
    runs = report.read_json(out)["runs"]
    assert [(r["variant"], r["baseline"], r["status"]) for r in runs] == [
        ("hf[eager]", True, "ok"), ("shardwise", False, "ok")]
    # the baseline's choice is the baseline's: the variant runs the model as loaded (HF's own)
    assert [r["experts_implementation"] for r in runs] == ["eager", "grouped_mm"]
    assert runs[1]["figures"]["speedup"]["decode"] > 0  # held against hf[eager]
    for rec in runs:
        f = rec["figures"]
        assert rec["decode_bytes_method"] == "dense + routed experts (measured)"
        assert f["decode_bytes"] == rec["decode_bytes"] < rec["weight_bytes"]
        assert f["decode_gbps"] == pytest.approx(
            rec["decode_bytes"] / (f["decode_ms"]["median"] / 1e3) / 1e9)
    assert f"GB/s of {MOE_TINY} is over the dense weights and the experts routed to" in \
        capsys.readouterr().out


# ----- running ------------------------------------------------------------------------------------------

def test_end_to_end_tiny_preset_writes_json_with_every_sample(tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["bench", "--preset", TINY, "--plain", "--batch", "1", "2", *FAST,
            "--output", str(out)]
    assert main(argv) == 0
    doc = report.read_json(out)
    recorded = doc["command"].split()
    assert recorded[:2] == ["shardwise", "bench"] and "--warmup" not in recorded  # a default
    assert _options(recorded[1:]) == _options(argv)
    assert [(r["variant"], r["batch"], r["status"]) for r in doc["runs"]] == [
        ("hf", 1, "ok"), ("shardwise", 1, "ok"), ("hf", 2, "ok"), ("shardwise", 2, "ok")]
    for rec in doc["runs"]:
        assert len(rec["samples"]["warmup"]) == 1 and len(rec["samples"]["repeats"]) == 2
        assert all(len(s["per_token_s"]) == 3 for s in rec["samples"]["repeats"])
        assert rec["weight_bytes"] == doc["runs"][0]["weight_bytes"] > 0
        assert rec["figures"]["bandwidth_pct"] > 0 and rec["peak_memory_bytes"] > 0
    assert doc["plan"]["models"] == [{"kind": "preset", "name": TINY, "path": None}]
    table = capsys.readouterr().out
    assert "ms/tok" in table and "results:" in table
    if chart.plotting_available():
        assert out.with_suffix(".png").stat().st_size > 1000


def test_a_failing_variant_is_reported_the_others_finish_and_the_exit_code_says_so(
        tmp_path, capsys, monkeypatch):
    from shardwise.errors import NotSupportedYetError

    def refuse(*_args, **_kwargs):  # quantization has landed: simulate an engine that refuses
        raise NotSupportedYetError("quant={'weight': {'num_bits': 8}} refused (simulated)")

    real_check = runner.check_positions

    def fail_long(model, cell):  # a cell failing at run time, e.g. out of memory
        if cell.prompt_len == 9:
            raise RuntimeError("out of memory (simulated)")
        real_check(model, cell)

    monkeypatch.setattr(runner, "prepare_shardwise", refuse)
    monkeypatch.setattr(runner, "check_positions", fail_long)
    out = tmp_path / "run.json"
    argv = ["bench", "--preset", TINY, *FAST, "--prompt-len", "8", "9", "--quant", "int8",
            "--output", str(out), "--no-chart"]
    assert main(argv) == 1  # every row printed and written, but a failed run is a failed bench
    runs = {(r["variant"], r["prompt_len"]): r for r in report.read_json(out)["runs"]}
    assert runs["hf", 8]["status"] == "ok" and runs["hf", 8]["figures"]["tokens_per_s"] > 0
    assert "out of memory (simulated)" in runs["hf", 9]["error"]
    assert runs["shardwise[int8]", 8]["error"].startswith("NotSupportedYetError: quant=")
    text = capsys.readouterr().out
    assert text.count("FAILED [1]") == 2 and text.count("FAILED [2]") == 1  # one note per error
    assert text.count("NotSupportedYetError") == 1


def test_without_matplotlib_the_bench_says_how_to_get_charts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(chart, "plotting_available", lambda: False)
    assert main(["bench", "--preset", TINY, "--plain", *FAST, "--new-tokens", "2",
                 "--repeats", "1", "--output", str(tmp_path / "r.json")]) == 0
    assert "pip install 'matplotlib>=3.7'" in capsys.readouterr().out
    assert not (tmp_path / "r.png").exists()


def test_the_readme_first_command_installs_what_the_default_chart_needs():
    """The main job writes a chart by default: the README's first command installs the plot
    extra, and the bench's hint names the same requirement."""
    import pathlib
    import re
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    first = re.search(r"```bash\n(.*?)\n```", (root / "README.md").read_text(), re.S).group(1)
    assert "shardwise bench" in first and "'.[plot]'" in first
    assert extras["plot"] == ["matplotlib>=3.7"] and extras["plot"][0] in chart.PLOT_INSTALL


def _options(argv: list[str]) -> dict:
    return {k: v for k, v in vars(build_parser().parse_args(argv)).items() if k != "_run"}


def test_recorded_command_parses_back_to_the_same_options():
    from shardwise.cli.bench import command_argv

    argv = ["bench", "--preset", TINY, "--preset", "gpt2-2l-64h", "--batch", "1", "4",
            "--tp", "2", "--quant", "int4", "--graphs", "--output", "x.json", "--ep", "1", "2",
            "--moe-dispatch", "all_to_all"]
    words = command_argv(build_parser().parse_args(argv))
    assert words[:4] == ["--preset", TINY, "--preset", "gpt2-2l-64h"]
    assert _options(["bench", *words]) == _options(argv)


# ----- --tp plumbing ------------------------------------------------------------------------------------

def _plan(tp=2):
    return Plan(models=[ModelSpec("preset", TINY)], cells=[Cell(1, 8, 4), Cell(2, 8, 4)],
                device="cpu", tp=tp, variants=[Variant(quant="int8")])


def test_variant_name_and_engine_kwargs():
    plan = _plan()
    [variant] = plan.variants
    assert plan.variant_names == ["shardwise[tp2,int8]"]
    assert plan.engine_kwargs(variant)["tensor_parallel"] == {"tp_size": 2}
    assert plan.engine_kwargs(variant)["quant"] == {"weight": {"num_bits": 8}}
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    both = Variant("bfloat16", inject=True, graphs=True, quant="int4")
    assert Plan([], [], "cpu", [both]).variant_names == ["shardwise[inject,graphs,int4]"]


def test_an_injected_variant_gets_a_cache_for_the_longest_cell():
    """A prompt + new tokens beyond the engine's default KV cache (1024) sizes the static cache
    to the longest cell; within it the default stays (so runs compare at one cache size)."""
    inject = Variant(inject=True)
    long = Plan([ModelSpec("preset", TINY)], [Cell(1, 128, 64), Cell(1, 2048, 8)], "cpu",
                [inject, Variant()])
    assert long.engine_kwargs(inject)["max_tokens"] == 2056
    assert "max_tokens" not in long.engine_kwargs(Variant())  # no static cache without it
    short = dataclasses.replace(long, cells=[Cell(8, 128, 64)])
    assert "max_tokens" not in short.engine_kwargs(inject)


def test_launch_command_and_environment():
    cmd = launch.launch_command("/s.json", 2, device="cpu")
    assert cmd[:3] == [sys.executable, "-m", "shardwise.launch"] and "--device=cpu" in cmd
    assert "--nproc-per-node=2" in cmd and "--standalone" in cmd
    assert cmd[-4:] == ["-m", "shardwise.bench.worker", "--spec", "/s.json"]
    multi = launch.launch_command("/s.json", 4, nnodes=2, node_rank=1, master_addr="h0",
                                  master_port=1234)
    assert {"--node-rank=1", "--master-addr=h0", "--master-port=1234"} <= set(multi)
    assert "--standalone" not in multi


def test_merge_ranks_takes_rank0_and_fails_runs_another_rank_failed():
    plan = _plan()
    ok = [runner.record(m, plan.variant_names[0], c) for m in plan.models for c in plan.cells]
    bad = copy.deepcopy(ok)
    bad[1].update(status="failed", error="CollectiveError: timeout")
    merged = launch.merge_ranks({0: ok, 1: bad}, plan, 1)
    assert [r["status"] for r in merged] == ["ok", "failed"]
    assert merged[1]["error"] == "rank 1: CollectiveError: timeout"
    lost = launch.merge_ranks({}, plan, 7)
    assert len(lost) == 2 and all("exited with code 7" in r["error"] for r in lost)


@pytest.mark.slow
def test_tp_launches_ranks_and_shards(tmp_path):
    """Two ranks started by the bench: the shardwise row runs tensor-parallel, each rank
    reading fewer weight bytes per step than the single-process baseline."""
    if CpuAccelerator().max_ranks_per_node() < 2:
        pytest.skip("needs 2 usable cores for 2 ranks")
    out = tmp_path / "tp.json"
    assert main(["bench", "--preset", TINY, "--plain", *FAST, "--repeats", "1", "--tp", "2",
                 "--output", str(out), "--no-chart"]) == 0
    runs = report.read_json(out)["runs"]
    assert [(r["variant"], r["status"], r["world_size"]) for r in runs] == [
        ("hf", "ok", 1), ("shardwise[tp2]", "ok", 2)], runs[-1].get("error")
    assert runs[1]["weight_bytes"] < runs[0]["weight_bytes"]


# ----- --ep: expert parallelism -------------------------------------------------------------------


@pytest.fixture
def many_cores(monkeypatch):
    """A CPU that hosts 16 ranks, so the sizes below are refused for what they are, not for
    this machine's core count."""
    monkeypatch.setattr(CpuAccelerator, "max_ranks_per_node", lambda self: 16)


@pytest.mark.parametrize("argv, says", [
    (["--preset", TINY, "--ep", "2"],
     f"--ep 2 splits the experts of a Mixture-of-Experts model over ranks, and {TINY} is a "
     f"dense model"),
    (["--ep", "2"], "--ep 2 needs an MoE model, and SmolLM2-135M-Instruct is not a preset"),
    (["--preset", MOE_TINY, "--preset", TINY, "--ep", "2"], f"and {TINY} is a dense model"),
    (["--preset", MOE_TINY, "--ep", "8"], f"--ep 8 is more than the 4 experts of {MOE_TINY}"),
    (["--preset", MOE_TINY, "--moe-dispatch", "all_to_all"],
     "--moe-dispatch all_to_all picks how expert-parallel ranks exchange the experts' work: it "
     "needs --ep > 1"),
    (["--preset", MOE_TINY, "--tp", "2", "--moe-dispatch", "all_reduce"], "needs --ep > 1"),
    # the engine's own plan, on a meta-device copy: 4 heads / 2 kv heads do not split by 3
    (["--preset", MOE_TINY, "--tp", "3", "--ep", "3"], f"--tp 3 --ep 3 (3 ranks) on {MOE_TINY}: "),
    # lcm(2, 4) = 4 ranks: an expert group of 4 spanning 2 replicas of a tp group (refused)
    (["--preset", MOE_TINY, "--tp", "2", "--ep", "4"], "--tp 2 --ep 4 (4 ranks) on "),
    (["--preset", MOE_TINY, "--ep", "0"], "must be positive, got --tp 1 --ep 0"),
])
def test_ep_bad_input_is_refused_before_any_load(no_heavy_work, many_cores, capsys, argv, says):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err, err


def test_ep_needs_ranks_the_node_hosts(no_heavy_work, capsys):
    too_many = CpuAccelerator().max_ranks_per_node() + 1
    assert main(["bench", "--preset", "moe-shared-12l-1024h-64e", "--ep", str(too_many)]) == 2
    err = capsys.readouterr().err
    assert f"--tp 1 --ep {too_many} needs {too_many} ranks" in err and "lower --tp/--ep" in err
    # too many for the experts too: the experts are named, the more basic problem
    assert main(["bench", "--preset", "moe-shared-2l-64h-8e", "--ep", "64"]) == 2
    assert "--ep 64 is more than the 8 experts of moe-shared-2l-64h-8e" in capsys.readouterr().err
    four = type("Acc", (CpuAccelerator,), {"max_ranks_per_node": lambda s: 4})()
    assert check_tp(four, 2, 1, ep=4) == 4  # --tp 2 --ep 4: lcm = 4 ranks, on one node
    with pytest.raises(ConfigError, match="needs 6 ranks"):
        check_tp(four, 2, 1, ep=3)
    with pytest.raises(ConfigError, match=r"\(4 ranks\) does not split evenly over --nnodes 3"):
        check_tp(four, 1, 3, ep=4)


def test_ep_world_variant_name_and_engine_kwargs():
    assert [world_size(*s) for s in ((1, 2), (2, 2), (2, 1), (4, 2), (2, 4), (2, 3))] == \
        [2, 2, 2, 4, 4, 6]  # the ranks are tp × dp with ep dividing them: lcm(tp, ep)
    plan = Plan(models=[ModelSpec("preset", MOE_TINY)], cells=[Cell(1, 8, 4)], device="cpu",
                tp=2, moe_dispatch="all_to_all",
                variants=[Variant(inject=True, quant="int8", ep=ep) for ep in (1, 2)])
    one, two = plan.variants
    assert plan.variant_names == ["shardwise[tp2,inject,int8]",
                                  "shardwise[tp2,ep2,all_to_all,inject,int8]"]
    assert [plan.world_of(v) for v in plan.variants] == [2, 2] and plan.world == 2
    assert "moe" not in plan.engine_kwargs(one)  # the dispatch is the ep variants'
    kwargs = plan.engine_kwargs(two)
    assert kwargs["moe"] == {"ep_size": 2, "dispatch": "all_to_all"}
    assert kwargs["tensor_parallel"] == {"tp_size": 2}
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert list(plan.by_world()) == [2]  # both on the same 2 ranks: one launch
    alone = Plan([ModelSpec("preset", MOE_TINY)], [], "cpu", [Variant(), Variant(ep=2)])
    assert alone.variant_names == ["shardwise", "shardwise[ep2]"] and alone.world == 2
    groups = alone.by_world()  # --ep 1 2: one variant here, one on 2 launched ranks
    assert {w: g.variants for w, g in groups.items()} == {1: [Variant()], 2: [Variant(ep=2)]}
    assert groups[2].world == 2 and groups[1].world == 1
    assert alone.engine_kwargs(Variant(ep=2))["moe"] == {"ep_size": 2}
    assert "tensor_parallel" not in alone.engine_kwargs(Variant(ep=2))
    old = alone.to_dict()
    for variant in old["variants"]:
        del variant["ep"]  # plans written before --ep
    assert Plan.from_dict(old).world == 1


def test_ep_plan_is_checked_and_recorded(many_cores):
    from shardwise.cli.bench import _plan as cli_plan

    plan, _, nproc, _ = cli_plan(build_parser().parse_args(
        ["bench", "--preset", MOE_TINY, "--ep", "2", "--inject", "--moe-dispatch", "all_reduce"]))
    assert (plan.tp, plan.world, nproc) == (1, 2, 2)
    assert plan.variant_names == ["shardwise[ep2,all_reduce,inject]"]
    plan, _, nproc, _ = cli_plan(build_parser().parse_args(
        ["bench", "--preset", MOE_TINY, "--ep", "1", "2", "2", "--inject"]))
    assert plan.variant_names == ["shardwise[inject]", "shardwise[ep2,inject]"]  # once each
    plan, *_ = cli_plan(build_parser().parse_args(["bench", "--preset", MOE_TINY, "--ep", "2"]))
    assert all(v.ep == 2 for v in plan.variants) and len(plan.variants) == 3  # the default set


def _sliced_experts_model(keep: int = 2):
    """The tiny Mixtral with each experts module holding only its first ``keep`` of 4 experts,
    as an expert-parallel rank's does (``num_experts`` left at the model's 4); their forward
    is a stand-in (only the routing they are called with matters here)."""
    model = _tiny_mixtral()
    for module in roofline.expert_modules(model):
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(param.data[:keep].clone()))
        module.forward = lambda x, index, weights: torch.zeros_like(x)
    return model


def test_ep_rank_bytes_are_its_dense_parts_and_its_own_experts_routed_to():
    """Under expert parallelism a rank's experts modules hold E_local experts and are called
    with local ids, E_local marking another rank's expert: the rank reads its dense parts and,
    of the experts routed to, only those it holds."""
    model = _sliced_experts_model(keep=2)
    whole = _tiny_mixtral()
    one_expert = (2 * 48 * 32 + 32 * 48) * 4
    dense = roofline.weight_bytes(whole) - 2 * 4 * one_expert
    layers = roofline.expert_modules(model)
    assert len(layers) == 2 and [roofline.local_experts(m) for m in layers] == [2, 2]
    assert roofline.expert_bytes(layers[0]) == 2 * one_expert
    hidden = torch.randn(2, 32)
    with roofline.RoutingCounter(model) as counter:
        for layer in layers:  # prefill
            layer(torch.randn(3, 32), torch.tensor([[0, 2]] * 3), torch.ones(3, 2))
        # local ids; 2 = an expert held by the other rank (contributes nothing, read nothing)
        layers[0](hidden, torch.tensor([[0, 2], [2, 2]]), torch.ones(2, 2))  # 1 of mine
        layers[1](hidden, torch.tensor([[0, 1], [1, 2]]), torch.ones(2, 2))  # 2 of mine
    assert counter.mean_distinct() == [1.0, 2.0]
    assert roofline.moe_decode_bytes(model, counter, 2) == (
        dense - _unread_rows(2) + 3 * one_expert, "dense + routed experts (measured)")
    # uniform expectation over the model's 4 experts, of the 2 held here: 2 × (1 − (1/2)^1)
    assert roofline.moe_decode_bytes(model, None, 1) == (
        dense - _unread_rows(1) + 2 * 1 * one_expert, "dense + routed experts (expected)")
    assert roofline.expected_distinct_experts(4, 2, 8, held=2) == pytest.approx(
        2 * (1 - 0.5 ** 8))


def test_gpt_oss_experts_with_2d_biases_are_found():
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          num_local_experts=4, num_experts_per_tok=2, vocab_size=64,
                          layer_types=["full_attention"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    [experts] = roofline.expert_modules(model)
    assert {p.dim() for p in experts.parameters(recurse=False)} == {2, 3}
    assert roofline.local_experts(experts) == 4


def test_merge_ranks_keeps_every_ranks_bytes_and_figures_give_each_ranks_gb_s():
    plan = _plan()
    step = {"prefill_s": 0.1, "per_token_s": [0.01, 0.01]}

    def rank_record(read, per_token=0.01):
        rec = runner.record(ModelSpec("preset", TINY), plan.variant_names[0], plan.cells[0],
                            weight_bytes=4 * 10**7, decode_bytes=read, world_size=2,
                            decode_bytes_method="dense + routed experts (measured)",
                            nonembedding_params=10**6, peak_memory_bytes=2**30)
        rec["samples"]["repeats"] = [dict(step, per_token_s=[per_token] * 2)] * 2
        return [rec]

    merged = launch.merge_ranks({0: rank_record(10**7), 1: rank_record(2 * 10**7, 0.02)},
                                plan, 0)
    assert [r["rank"] for r in merged[0]["ranks"]] == [0, 1]
    assert [r["decode_s"] for r in merged[0]["ranks"]] == [0.01, 0.02]
    doc = _document(runs=[_record(), *merged])
    f = doc["runs"][1]["figures"]
    assert f["decode_gbps"] == pytest.approx(1.0)  # the row is rank 0's: 1e7 B / 10 ms
    assert [r["decode_gbps"] for r in f["ranks"]] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert f["ranks"][1]["bandwidth_pct"] == pytest.approx(1.0)  # of the 100 GB/s measured
    # together: 3e7 B over the slowest rank's 20 ms step
    assert f["all_ranks"]["decode_gbps"] == pytest.approx(1.5)
    assert f["all_ranks"]["decode_bytes"] == 3 * 10**7
    text = report.format_table(doc)
    assert f"GB/s per rank of {plan.variant_names[0]} on {TINY} batch 1" in text
    assert "rank 0 1 (1.0%), rank 1 1 (1.0%); all ranks together 1.5 (1.5%)" in text
    assert "ranks" not in launch.merge_ranks({0: rank_record(10**7)}, plan, 0)[0]


def test_prefill_counts_the_active_parameters_of_an_moe_model():
    """A prompt token multiplies the dense weights and top_k of num_experts experts: prefill
    TFLOP/s counts those (per rank, the top-k share of the experts it holds)."""
    model = _tiny_mixtral()
    experts = 2 * 4 * (2 * 48 * 32 + 32 * 48)  # 2 layers × 4 experts (gate_up + down)
    total = roofline.nonembedding_parameters(model)
    assert roofline.active_parameters(model) == total - experts + experts // 2  # top-2 of 4
    sliced = _sliced_experts_model(keep=2)  # an ep rank holding 2 of the 4
    assert roofline.active_parameters(sliced) == total - experts + experts // 4
    dense = tiny_causal_lm("llama")
    assert roofline.active_parameters(dense) == roofline.nonembedding_parameters(dense)
    rec = _record(active_params=10**7)  # 10x fewer than its nonembedding_params
    assert figures(rec, None)["prefill_tflops"] == pytest.approx(2 * 1e7 * 16 * 2 / 0.2 / 1e12)


class _QuantExpertsStandIn(torch.nn.Module):
    """What the bench needs of a quantized experts module (shardwise.quant.QuantExperts): its
    packed weights as buffers, counts_buffers_as_weights, num_experts (those held), hidden_dim
    and intermediate_dim."""

    counts_buffers_as_weights = True

    def __init__(self, experts=4, hidden=32, inter=48):
        super().__init__()
        self.num_experts, self.hidden_dim, self.intermediate_dim = experts, hidden, inter
        self.register_buffer("gate_up_q", torch.zeros(experts * 2 * inter * hidden,
                                                      dtype=torch.int8))
        self.register_buffer("down_q", torch.zeros(experts * hidden * inter, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(experts, 3 * inter))

    def forward(self, x, index, weights):
        return torch.zeros_like(x)


def test_quantized_experts_are_counted_as_experts():
    model = _tiny_mixtral()
    for layer in model.model.layers:
        layer.mlp.experts = _QuantExpertsStandIn(experts=2)  # an ep rank's, quantized
    layers = roofline.expert_modules(model)
    assert len(layers) == 2 and [roofline.local_experts(m) for m in layers] == [2, 2]
    one_expert = 3 * 48 * 32 + 3 * 48 * 4  # int8 weights + fp32 scales
    assert roofline.expert_bytes(layers[0]) == 2 * one_expert
    dense = roofline.weight_bytes(_tiny_mixtral()) - 2 * 4 * (3 * 48 * 32 * 4)
    assert roofline.weight_bytes(model) == dense + 2 * 2 * one_expert
    with roofline.RoutingCounter(model) as counter:
        for layer in layers:
            layer(torch.randn(3, 32), torch.tensor([[0, 1]] * 3), torch.ones(3, 2))  # prefill
            layer(torch.randn(1, 32), torch.tensor([[1, 2]]), torch.ones(1, 2))  # 1 of mine
    assert roofline.moe_decode_bytes(model, counter, 1) == (
        dense - _unread_rows(1) + 2 * one_expert, "dense + routed experts (measured)")
    held = 2 * 2 * 3 * 48 * 32  # counted as the parameters they replace
    assert roofline.expert_parameters(layers[0]) == held // 2
    experts_and_dense = roofline.nonembedding_parameters(model)
    assert roofline.active_parameters(model) == experts_and_dense - held + held // 2


def test_moe_rows_record_what_the_experts_ran():
    model = _tiny_mixtral()
    assert runner.experts_implementation(model) == "grouped_mm"  # HF 5.23's default
    model.model.layers[0].mlp.experts.forward = lambda x, index, weights: x  # the MoE step's
    assert runner.experts_implementation(model) == "shardwise moe kernels/grouped_mm"
    model.model.layers[1].mlp.experts = _QuantExpertsStandIn()
    assert runner.experts_implementation(model) == \
        "shardwise moe kernels/shardwise _QuantExpertsStandIn"
    assert runner.experts_implementation(tiny_causal_lm("llama")) is None


@pytest.mark.slow
def test_ep_launches_ranks_each_holding_and_reading_its_own_experts(tmp_path):
    """--tp 2 --ep 2 with injection and the all-to-all dispatch: two ranks started by the
    bench, heads split by tp and experts by ep; each rank holds half the experts and its
    bytes per decode step are its own dense shards and its own experts routed to."""
    if CpuAccelerator().max_ranks_per_node() < 2:
        pytest.skip("needs 2 usable cores for 2 ranks")
    out = tmp_path / "ep.json"
    assert main(["bench", "--preset", MOE_TINY, "--inject", "--tp", "2", "--ep", "2",
                 "--moe-dispatch", "all_to_all", *FAST, "--repeats", "1", "--batch", "2",
                 "--output", str(out), "--no-chart"]) == 0
    hf, ep = report.read_json(out)["runs"]
    assert [(r["variant"], r["status"], r["world_size"]) for r in (hf, ep)] == [
        ("hf", "ok", 1), ("shardwise[tp2,ep2,all_to_all,inject]", "ok", 2)], ep.get("error")
    assert ep["experts_implementation"] == "shardwise moe kernels"
    one_expert = (2 * 128 * 64 + 64 * 128) * 4  # the preset's gate_up + down, fp32
    assert [r["rank"] for r in ep["ranks"]] == [0, 1]
    for rank, figures_of_rank in zip(ep["ranks"], ep["figures"]["ranks"]):
        assert rank["status"] == "ok" and rank["decode_s"] > 0
        # 2 of 4 experts in each of 2 layers, and half the attention: well under HF's bytes
        assert rank["weight_bytes"] < hf["weight_bytes"] - 2 * 2 * one_expert
        assert rank["decode_bytes_method"] == "dense + routed experts (measured)"
        assert rank["decode_bytes"] <= rank["weight_bytes"]
        assert figures_of_rank["decode_gbps"] == pytest.approx(
            rank["decode_bytes"] / rank["decode_s"] / 1e9)
    assert ep["figures"]["all_ranks"]["decode_bytes"] == sum(
        r["decode_bytes"] for r in ep["ranks"])
