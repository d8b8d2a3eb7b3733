"""``shardwise bench --offload nvme|cpu``: the options refused before anything runs, the variant
and engine settings they make, the tier's probes, the figures from the engine's counters, and a
tiny end-to-end run streaming from disk."""

from __future__ import annotations

import sys

import pytest

import shardwise.bench.runner as runner
import shardwise.bench.session as session
from shardwise.accelerators.cpu import CpuAccelerator
from shardwise.bench import chart, report
from shardwise.bench.figures import add_figures
from shardwise.bench.offload import (OffloadMeter, TierProbe, format_offload,
                                     host_to_device_probe, offload_figures, probe_tier,
                                     process_memory)
from shardwise.bench.plan import Cell, ModelSpec, Plan, Variant
from shardwise.cli import build_parser, main

TINY = "llama-2l-64h-gqa"


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Fail the test if a model is loaded or any probe runs."""
    def forbidden(*args, **kwargs):
        raise AssertionError("heavy work started before the input was validated")

    for module, name in ((runner, "load"), (session, "measure_bandwidth"),
                         (session, "run_ranks"), (session, "probe_tier")):
        monkeypatch.setattr(module, name, forbidden)


# ----- bad input ----------------------------------------------------------------------------------

def _refusals(tmp_path):
    """(argv after the preset, words the one-line error must hold)."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (tmp_path / "a-file").write_text("")
    cases = [
        (["--offload", "nvme"], ["--offload nvme:", "nvme_path", "here nvme_path is --nvme-path"]),
        (["--offload", "nvme", "--nvme-path", str(tmp_path / "missing")], ["does not exist"]),
        (["--offload", "nvme", "--nvme-path", str(tmp_path / "a-file")], ["not a directory"]),
        (["--offload", "nvme", "--nvme-path", str(blobs), "--buffer-count", "1"],
         [">= 2", "got 1", "buffer_count is --buffer-count"]),
        (["--offload", "cpu"], ["computes in host memory", "'nvme'"]),  # the CPU plugin's
        (["--offload", "cpu", "--nvme-path", str(blobs)], ["used only by device 'nvme'"]),
        (["--nvme-path", str(blobs)], ["--nvme-path: used only by --offload", "drop it"]),
        (["--buffer-count", "3", "--nvme-path", str(blobs)],
         ["--nvme-path, --buffer-count: used only by --offload", "drop them"]),
    ]
    if sys.platform.startswith("linux"):
        cases.append((["--offload", "nvme", "--nvme-path", "/proc"], ["not writable"]))
    return cases


def test_offload_options_are_refused_in_one_line_before_anything_runs(no_heavy_work, tmp_path,
                                                                      capsys):
    for argv, says in _refusals(tmp_path):
        assert main(["bench", "--preset", TINY, *argv, "--output",
                     str(tmp_path / "r.json")]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert all(word in err for word in says) and "\n" not in err, (argv, err)
    assert not any((tmp_path / "blobs").iterdir())  # nothing written where the blobs go
    assert not (tmp_path / "r.json").exists()


# ----- the variant --------------------------------------------------------------------------------

def _cli_plan(argv):
    from shardwise.cli.bench import _plan

    return _plan(build_parser().parse_args(["bench", "--preset", TINY, *argv]))[0]


def test_offload_is_a_variant_option_and_reaches_init_inference(tmp_path):
    plan = _cli_plan(["--offload", "nvme", "--nvme-path", str(tmp_path)])
    assert plan.variant_names == ["shardwise[offload-nvme]"]  # not the default set
    assert plan.offload_tier == "nvme" and plan.baseline_dtype is None  # the model's own dtype
    assert plan.engine_kwargs(plan.variants[0])["offload"] == {"device": "nvme",
                                                               "nvme_path": str(tmp_path)}
    plan = _cli_plan(["--offload", "nvme", "--nvme-path", str(tmp_path), "--buffer-count", "3",
                      "--inject", "--quant", "int4"])
    (variant,) = plan.variants
    assert plan.variant_name(variant) == "shardwise[inject,int4,offload-nvme]"
    kwargs = plan.engine_kwargs(variant)
    assert kwargs["offload"] == {"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 3}
    assert kwargs["replace_with_kernel_inject"] and "enable_graph" not in kwargs
    again = Plan.from_dict(plan.to_dict())  # what the --tp ranks read back
    assert again.engine_kwargs(again.variants[0]) == kwargs
    assert _cli_plan(["--inject"]).offload_tier is None
    assert "offload" not in _cli_plan(["--inject"]).engine_kwargs(Variant(inject=True))


# ----- the tier's probe ---------------------------------------------------------------------------

def test_nvme_probe_reads_the_directory_and_leaves_nothing(tmp_path):
    probe = probe_tier("nvme", CpuAccelerator(), str(tmp_path), nbytes=4 << 20)
    assert probe.tier == "nvme" and probe.path == str(tmp_path)
    assert probe.method == ("O_DIRECT read" if probe.direct_io else "buffered read")
    assert probe.nbytes >= 4 << 20 and probe.gbps > 0
    assert list(tmp_path.iterdir()) == []
    both = probe.add(TierProbe("nvme", probe.method, probe.nbytes, probe.path, probe.direct_io,
                               [probe.gbps * 2]))
    assert both.gbps == probe.gbps * 2 and both.to_dict()["probes_gbps"] == [probe.gbps,
                                                                               probe.gbps * 2]
    with pytest.raises(ValueError):
        probe.add(TierProbe("cpu", "pinned host-to-device copy", 1, probes_gbps=[1.0]))


def test_copy_probe_times_a_copy_into_the_device():
    # on the CPU plugin there is no page-locking to do, so the copy is timed unpinned
    assert host_to_device_probe(CpuAccelerator(), 1 << 20, repeats=2, pin=False) > 0


# ----- the figures --------------------------------------------------------------------------------

class FakeReport:
    """An engine's offload report as the bench reads it: facts and counters."""

    tier, path, ring_bytes, resident_bytes = "nvme", "/blobs/abc", 2 * 4096, 512
    streamed_bytes_per_pass, direct_io, fallback_reason, reused = 3 * 4096, True, None, False
    units, stale = ("embed", "layer0", "head"), ()

    def __init__(self):
        self.resets = 0
        self.counters = {"bytes_read": 0, "read_s": 0.0, "wait_s": 0.0, "overlap": None,
                         "passes": 0}

    def reset_stats(self):
        self.resets += 1

    def stats(self):
        return {**self.counters, "per_pass": [{"bytes_read": 1}]}  # logs are not kept


def test_meter_keeps_the_counters_of_the_timed_repeats_and_the_peak_rss():
    fake = FakeReport()
    meter = OffloadMeter(fake, rss_before_load=1000)
    meter.start_cell()
    assert fake.resets == 0  # the warm-up still counts as the engine likes
    meter.start_timed()
    fake.counters = {"bytes_read": 8 * 12288, "read_s": 0.4, "wait_s": 0.1, "overlap": 0.75,
                     "passes": 8}
    facts = meter.finish()
    assert fake.resets == 1
    assert facts["stats"] == fake.counters and facts["units"] == 3 and facts["stale"] == []
    assert facts["streamed_bytes_per_pass"] == 12288 and facts["rss_before_load_bytes"] == 1000
    if process_memory():  # Linux
        assert facts["peak_rss_bytes"] >= facts["rss_start_bytes"] > 0


def test_offload_figures_from_known_counters():
    rec = runner.record(ModelSpec("preset", TINY), "shardwise[offload-nvme]", Cell(2, 8, 3),
                        weight_bytes=1000, nonembedding_params=100)
    rec["samples"]["repeats"] = [{"prefill_s": 0.5, "per_token_s": [0.02, 0.04]},
                                 {"prefill_s": 0.5, "per_token_s": [0.03, 0.05]}]
    rec["offload"] = {"stats": {"bytes_read": 6 * 3_000_000, "read_s": 0.1, "wait_s": 0.012,
                                "overlap": 0.88, "passes": 6},
                      "peak_rss_bytes": 5_000, "rss_before_load_bytes": 3_000,
                      "ring_bytes": 2 << 20}
    (out,) = add_figures([rec], device_gbps=10.0, probe_gbps=0.2)
    f = out["figures"]["offload"]
    step = 0.035  # median of the four decode steps
    assert f["step_bytes"] == 3_000_000
    assert f["stream_gbps"] == pytest.approx(3_000_000 / step / 1e9)
    assert f["probe_pct"] == pytest.approx(100 * 3_000_000 / step / 1e9 / 0.2)
    assert f["overlap"] == 0.88 and f["wait_ms_per_step"] == pytest.approx(2.0)
    assert f["peak_rss_bytes"] == 5_000 and f["rss_growth_bytes"] == 2_000
    assert offload_figures({"offload": None}, step, 0.2) is None
    nothing = dict(rec, offload={"stats": {"bytes_read": 0, "wait_s": 0.0, "passes": 0}})
    assert offload_figures(nothing, step, 0.2)["stream_gbps"] is None  # no pass: no rate
    doc = {"runs": [out], "offload_probe": TierProbe("nvme", "O_DIRECT read", 1 << 20, "/d",
                                                     True, [0.1, 0.2]).to_dict()}
    text = format_offload(doc)
    assert "offload (nvme): O_DIRECT read of /d, 1 MiB: 0.20 GB/s (highest of 0.10, 0.20)" in text
    assert "% probe" in text and f"{f['probe_pct']:.1f}" in text
    assert format_offload({"runs": [dict(out, offload=None)]}) == ""


# ----- a run --------------------------------------------------------------------------------------

def test_tiny_preset_streams_from_disk_and_reports_against_the_probe(tmp_path, capsys):
    blobs, out = tmp_path / "blobs", tmp_path / "run.json"
    blobs.mkdir()
    new_tokens, repeats = 4, 1
    # 2 ring slots for its 4 units (embedding, 2 layers, head): every pass reads every unit
    argv = ["bench", "--preset", TINY, "--offload", "nvme", "--nvme-path", str(blobs),
            "--buffer-count", "2", "--new-tokens", str(new_tokens), "--repeats", str(repeats),
            "--prompt-len", "8", "--bandwidth-mib", "8", "--no-progress", "--output", str(out)]
    assert main(argv) == 0
    doc = report.read_json(out)
    probe = doc["offload_probe"]
    assert probe["tier"] == "nvme" and probe["path"] == str(blobs)
    assert len(probe["probes_gbps"]) == 2 and probe["gbps"] == max(probe["probes_gbps"]) > 0
    assert [(r["variant"], r["status"]) for r in doc["runs"]] == [
        ("hf", "ok"), ("shardwise[offload-nvme]", "ok")]
    hf, rec = doc["runs"]
    assert "offload" not in hf and "offload" not in hf["figures"]
    facts, f = rec["offload"], rec["figures"]["offload"]
    assert facts["tier"] == "nvme" and facts["units"] == 4 and facts["ring_bytes"] > 0
    assert facts["stats"]["passes"] == repeats * new_tokens  # one pass per forward
    per_pass = facts["streamed_bytes_per_pass"]
    assert 0.5 * per_pass <= f["step_bytes"] <= 1.5 * per_pass
    step_s = rec["figures"]["decode_ms"]["median"] / 1e3
    assert f["stream_gbps"] == pytest.approx(f["step_bytes"] / step_s / 1e9)
    assert f["probe_pct"] == pytest.approx(100 * f["stream_gbps"] / probe["gbps"])
    assert 0 <= f["overlap"] <= 1 and f["wait_ms_per_step"] >= 0
    assert f["peak_rss_bytes"] > 0 and f["rss_growth_bytes"] is not None
    assert any(blobs.iterdir())  # the repacked weights are there for the next run
    table = capsys.readouterr().out
    assert f"offload (nvme): {probe['method']} of {blobs}" in table and "% probe" in table
    if chart.plotting_available():
        assert out.with_suffix(".png").stat().st_size > 1000
