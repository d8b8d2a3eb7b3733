"""``shardwise bench --pp P [--micro-batches M]``: the plain variant over P pipeline stages on P
launched ranks, each row reporting every stage's busy time over the timed repeats and the
measured bubble against the theoretical (P − 1)/(P − 1 + M) (the JSON's ``pipeline`` and a
printed section). Bad combinations fail in one line before anything runs; one real run on 2
ranks checks the figures end to end.
"""

from __future__ import annotations

import json

import pytest

from shardwise.bench.pipeline import format_pipeline
from shardwise.cli import build_parser, main

TINY = "gpt2-2l-64h"


@pytest.mark.parametrize("argv, says", [
    (["--micro-batches", "4"], "--micro-batches 4 splits each forward for the pipeline stages: "
                               "it needs --pp > 1"),
    (["--pp", "2", "--offload", "cpu"], "--pp 2 does not run with --offload yet"),
    (["--pp", "0"], "--pp must be a positive number of pipeline stages, got 0"),
    (["--pp", "4", "--nnodes", "2"], "pp_size=4 is more than the 2 decoder layers"),  # engine's
    (["--pp", "64"], "--pp 64 needs 64 ranks"),
])
def test_bad_pipeline_options_fail_in_one_line_before_anything_runs(no_heavy_work, capsys,
                                                                    argv, says):
    assert main(["bench", "--preset", TINY, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err, err


def _plan(argv):
    from shardwise.cli.bench import _plan as cli_plan

    return cli_plan(build_parser().parse_args(["bench", "--preset", TINY, *argv]))


def test_pp_times_injected_and_quantized_variants_over_the_stages():
    plan, _, _, notes = _plan(["--pp", "2", "--inject", "--quant", "int8"])
    assert plan.variant_names == ["shardwise[pp2,mb4,inject,int8]"]
    assert not any("plain variant" in n for n in notes)
    kwargs = plan.engine_kwargs(plan.variants[0])
    assert kwargs["pipeline_parallel"] == {"pp_size": 2, "micro_batches": 4}
    assert kwargs["replace_with_kernel_inject"] and kwargs["quant"]


@pytest.mark.parametrize("argv, world, micro, name", [
    (["--pp", "2"], 2, 4, "shardwise[pp2,mb4]"),  # M defaults to 2P
    (["--pp", "2", "--micro-batches", "3"], 2, 3, "shardwise[pp2,mb3]"),
    (["--pp", "2", "--tp", "2", "--plain", "--nnodes", "2"], 4, 4, "shardwise[pp2,mb4,tp2]"),
])
def test_pp_runs_the_plain_variant_on_pp_times_tp_ranks(argv, world, micro, name):
    plan, _, nproc, notes = _plan(argv)
    assert plan.world == world == nproc * plan.nnodes and plan.variant_names == [name]
    kwargs = plan.engine_kwargs(plan.variants[0])
    assert kwargs["pipeline_parallel"] == {"pp_size": 2, "micro_batches": micro}
    assert not plan.variants[0].inject and not plan.variants[0].quant
    if "--plain" not in argv:
        assert any("--pp 2: the plain variant (add --inject" in n for n in notes)
    assert any("a batch of 1 runs as one micro-batch" in n for n in notes)  # --batch 1


def test_a_batch_of_one_has_no_pipeline_figures():
    from shardwise.pipeline import PipelineReport

    report = PipelineReport(None, (), 0, (), micro_batches=4)
    report._steps[:] = [0, 0.0, 0.0]  # no forward was split: nothing gathered, no collective
    assert report.finish_steps() is None and report.stats is None


def test_the_pipeline_section_shows_every_stage():
    stats = {"micro_batches": 4, "stages": 2, "wall_s": 0.5, "busy_s": [0.4, 0.3], "steps": 8,
             "bubble": [0.2, 0.4], "theoretical_bubble": 0.2, "layers_s": [0.35, 0.2]}
    doc = {"runs": [{"model": TINY, "variant": "shardwise[pp2,mb4]", "batch": 4,
                     "new_tokens": 4, "status": "ok", "pipeline": stats},
                    {"model": TINY, "variant": "hf", "batch": 4, "new_tokens": 4,
                     "status": "ok"}]}
    text = format_pipeline(doc)
    row = text.splitlines()[-1].split()
    assert row[:8] == [TINY, "shardwise[pp2,mb4]", "4", "4", "4", "8", "500.0", "400.0,"]
    assert row[8:] == ["300.0", "20.0%,", "40.0%", "20.0%", "2.00", "70%,", "40%"]
    assert format_pipeline({"runs": doc["runs"][1:]}) == ""


@pytest.mark.slow
def test_a_pp2_bench_reports_each_stage_and_the_bubble(tmp_path, capsys):
    out = tmp_path / "pp.json"
    argv = ["bench", "--preset", TINY, "--pp", "2", "--batch", "4", "--new-tokens", "4",
            "--prompt-len", "8", "--warmup", "1", "--repeats", "2", "--bandwidth-mib", "8",
            "--no-progress", "--no-chart", "--output", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    (run,) = [r for r in doc["runs"] if not r["baseline"]]
    assert run["variant"] == "shardwise[pp2,mb4]" and run["status"] == "ok"
    p = run["pipeline"]
    assert (p["stages"], p["micro_batches"], p["steps"]) == (2, 4, 2 * 4)  # repeats x tokens
    assert p["theoretical_bubble"] == pytest.approx(0.2)
    assert len(p["busy_s"]) == len(p["bubble"]) == 2
    assert len(p["layers_s"]) == 2
    for busy, bubble, layers in zip(p["busy_s"], p["bubble"], p["layers_s"]):
        assert 0 < busy < p["wall_s"] and bubble == pytest.approx(1 - busy / p["wall_s"])
        assert 0 < layers < busy  # the layers are part of the busy time
    assert "pipeline stages (timed repeats" in printed and "shardwise[pp2,mb4]" in printed
