"""Offloaded inference (``offload=``, issue 17): the units stream from a disk store through a ring
of ``buffer_count`` slots, and the model computes exactly what it computes resident.

Every case runs a tiny fp32 model from the ``"nvme"`` tier under pytest's ``tmp_path`` (on this
CPU the slots are the compute memory; reads are direct I/O where the filesystem allows it) and
compares it with the *same* model, built with the same settings, resident: greedy tokens
identical and logits within 1e-5 (quantized models against the same quantized model resident;
BERT on its hidden states). Then: every unit was read, reads overlap compute (from the ring's
event log, not timing), the resident copies are gone, a second init reuses the store, another
model's weights do not, ``close()`` gives back a working model, out-of-order use of a unit
works, and tensor parallelism (2 gloo ranks) streams each rank's shard only.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import shardwise
from models import prompt_ids, tiny_causal_lm, tiny_encoder
from shardwise.offload.transform import offload_units
from tp_harness import TP, case, table_fixture

#: logits of the offloaded model against the same model resident (the same kernels run on the
#: same bytes, so they are expected to be equal; the bound leaves room for nothing else)
ATOL = 1e-5
NEW_TOKENS = 12
GREEDY = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
              pad_token_id=0)

#: (arch, replace_with_kernel_inject, quant bits or None, buffer_count)
CAUSAL_CASES = [
    ("llama", False, None, 2), ("llama", True, None, 3), ("llama", False, 8, 3),
    ("llama", True, 8, 2), ("llama", False, 4, 2), ("llama", True, 4, 3),
    ("gpt2", False, None, 3), ("gpt2", True, None, 2), ("gpt2", False, 8, 2),
    ("gpt2", True, 4, 3),
    ("mixtral", False, None, 2), ("mixtral", True, None, 3), ("mixtral", False, 4, 3),
    ("mixtral", True, 8, 2),
]
ENCODER_CASES = [("bert", False, None, 2), ("bert", True, None, 3), ("bert", False, 8, 3),
                 ("bert", True, 8, 2)]


def _case_id(c) -> str:
    arch, inject, bits, k = c
    return f"{arch}-{'inject' if inject else 'hf'}-{f'int{bits}' if bits else 'fp32'}-k{k}"


def _settings(inject: bool, bits: int | None) -> dict:
    kw = {"device": "cpu", "dtype": torch.float32, "replace_with_kernel_inject": inject}
    if bits:
        kw["quant"] = {"weight": {"num_bits": bits}}
    return kw


def _offload(path, k: int = 2) -> dict:
    return {"device": "nvme", "nvme_path": str(path), "buffer_count": k}


def _slot_ranges(engine) -> list[tuple[int, int]]:
    slots = engine.offload.ring.loader.slots
    return [(s.data_ptr(), s.data_ptr() + s.numel()) for s in slots]


def _in_slots(t: torch.Tensor, ranges) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(lo <= ptr < hi for lo, hi in ranges)


def _unit_tensors(engine) -> list[torch.Tensor]:
    """The tensors the model holds now at every streamed place."""
    return [ref.current() for u in offload_units(engine.module, engine.plan, engine._stack)
            for ref in u.tensors]


def _assert_streamed_only(engine) -> None:
    """Every unit was read, and the unit tensors live in the ring's slots (no resident copy)."""
    stats = engine.offload.stats()
    assert stats["units_read"] == len(engine.offload.units)
    assert stats["bytes_read"] >= engine.offload.streamed_bytes_per_pass
    assert stats["passes"] >= 1
    ranges = _slot_ranges(engine)
    held = _unit_tensors(engine)
    assert held and all(_in_slots(t, ranges) for t in held)
    # nor does the engine's record of the model keep the originals (close() reads them back)
    assert engine._ledger.held_bytes()["parameters"] == 0


# ----- parity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("c", CAUSAL_CASES, ids=_case_id)
def test_causal_lm_matches_the_resident_model(c, tmp_path):
    arch, inject, bits, k = c
    ids = prompt_ids(batch=2, length=8)
    resident = shardwise.init_inference(tiny_causal_lm(arch), **_settings(inject, bits))
    ref_logits = resident(input_ids=ids).logits
    ref_tokens = resident.generate(ids, **GREEDY)
    engine = shardwise.init_inference(tiny_causal_lm(arch), offload=_offload(tmp_path, k),
                                      **_settings(inject, bits))
    engine.offload.reset_stats()
    logits = engine(input_ids=ids).logits
    tokens = engine.generate(ids, **GREEDY)
    print(f"{_case_id(c)}: max |logit diff| {(logits - ref_logits).abs().max():.2e}; "
          f"{engine.offload.summary()}")
    assert (logits - ref_logits).abs().max() <= ATOL
    assert torch.equal(tokens, ref_tokens)
    _assert_streamed_only(engine)
    assert engine.offload.stats()["passes"] >= NEW_TOKENS  # a pass over the units per step


@pytest.mark.parametrize("c", ENCODER_CASES, ids=_case_id)
def test_bert_hidden_states_match_the_resident_model(c, tmp_path):
    arch, inject, bits, k = c
    ids = prompt_ids(batch=2, length=12)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on the second row
    resident = shardwise.init_inference(tiny_encoder(arch, head="base"), **_settings(inject, bits))
    ref = resident(input_ids=ids, attention_mask=mask)
    engine = shardwise.init_inference(tiny_encoder(arch, head="base"),
                                      offload=_offload(tmp_path, k), **_settings(inject, bits))
    out = engine(input_ids=ids, attention_mask=mask)
    for name in ("last_hidden_state", "pooler_output"):
        diff = (getattr(out, name) - getattr(ref, name)).abs().max()
        assert diff <= ATOL, f"{name} differs by {diff:.2e}"
    _assert_streamed_only(engine)


# ----- the ring ----------------------------------------------------------------------------------


def _prefetched_pairs(events) -> list[tuple[int, int, bool]]:
    """For each unit acquired right after another, (previous, next, whether next's load was
    submitted before previous began computing): from the ring's event log."""
    submitted_at: dict[int, int] = {}
    acquires = []
    for pos, (kind, unit, _) in enumerate(events):
        if kind == "submit":
            submitted_at[unit] = pos
        elif kind == "acquire":
            acquires.append((pos, unit, submitted_at.get(unit)))
    return [(prev_unit, unit, sub is not None and sub < prev_pos)
            for (prev_pos, prev_unit, _), (_, unit, sub) in zip(acquires, acquires[1:])]


@pytest.mark.parametrize("k", [2, 3])
def test_the_next_units_are_read_while_one_computes(k, tmp_path):
    engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu", dtype=torch.float32,
                                      offload=_offload(tmp_path, k))
    engine.generate(prompt_ids(batch=1, length=8), **GREEDY)  # the log begins at init
    events = engine.offload.events
    pairs = _prefetched_pairs(events)
    n = len(engine.offload.units)
    assert len(pairs) >= n * NEW_TOKENS - 1
    late = [(a, b) for a, b, early in pairs if not early]
    assert not late, f"these units' loads began only after the unit before them started: {late}"
    # K - 1 loads are in flight while a unit computes: at each acquire, the next K - 1 units
    # in cyclic order are in slots or loading (submitted, not yet acquired since)
    pending, depths = set(), []
    for kind, unit, _ in events:
        if kind == "submit":
            pending.add(unit)
        elif kind == "acquire":
            pending.discard(unit)
            depths.append(len(pending))
    assert min(depths) >= k - 1, depths
    # a pass reads every unit once (4 units > k slots: nothing stays cached between passes)
    stats = engine.offload.stats()
    assert stats["bytes_per_pass"] == pytest.approx(engine.offload.streamed_bytes_per_pass,
                                                    rel=0.5)
    assert stats["overlap"] is not None and 0 <= stats["overlap"] <= 1


def test_a_unit_used_out_of_order_is_loaded_then(tmp_path):
    ref = tiny_causal_lm("llama")
    engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu", dtype=torch.float32,
                                      offload=_offload(tmp_path, 2))
    x = torch.randn(1, 3, ref.config.hidden_size)
    with torch.no_grad():
        rotary = ref.model.rotary_emb(x, torch.arange(3)[None])
        # the head, then the last layer, then the first: none is the ring's next unit
        assert torch.allclose(engine.module.lm_head(x), ref.lm_head(x), atol=ATOL)
        for i in (1, 0):
            assert torch.allclose(_first(engine.module.model.layers[i](
                x, position_embeddings=rotary)), _first(ref.model.layers[i](
                    x, position_embeddings=rotary)), atol=ATOL)
        ids = prompt_ids(batch=1, length=8)
        assert torch.equal(engine.generate(ids, **GREEDY), ref.generate(ids, **GREEDY))


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def test_a_failed_read_names_the_file_and_the_next_forward_reads_again(tmp_path):
    from shardwise.offload.store import unit_filename

    ids = prompt_ids(batch=1, length=8)
    ref_tokens = tiny_causal_lm("llama").generate(ids, **GREEDY)
    engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu", dtype=torch.float32,
                                      offload=_offload(tmp_path, 2))
    blob = Path(engine.offload.path) / unit_filename(2)  # model.layers.1: not in the first slots
    saved = blob.read_bytes()
    blob.write_bytes(saved[:len(saved) // 2])
    with pytest.raises(OSError, match=blob.name):
        engine.generate(ids, **GREEDY)
    blob.write_bytes(saved)
    assert torch.equal(engine.generate(ids, **GREEDY), ref_tokens)


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_the_copy_stream_path_of_an_accelerator_on_host_slots(tier, tmp_path, monkeypatch):
    """The generic accelerator path (host blob or staging slot → slot on a copy stream, events
    for compute), run on this CPU by telling the offload step the device has memory of its own
    (the engine's checks would refuse a model already there: the step is called directly). The
    CPU has no device events: a stand-in logs what the path asks of them."""
    from shardwise.offload import ring as ring_module
    from shardwise.offload.ring import DeviceLoader
    from shardwise.offload.transform import offload_model

    log = []

    class LoggedEvent:
        def __init__(self, device):
            self.id = len(log)
            log.append(("new", self.id))

        def record(self, stream=None):
            log.append(("record", self.id))

        def wait(self, stream=None):
            log.append(("wait", self.id))

        def synchronize(self):
            log.append(("synchronize", self.id))
    monkeypatch.setattr(ring_module, "device_event", LoggedEvent)

    ids = prompt_ids(batch=2, length=8)
    resident = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                        dtype=torch.float32)
    ref_tokens = resident.generate(ids, **GREEDY)
    engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                      dtype=torch.float32)
    monkeypatch.setattr(engine.accelerator, "computes_in_host_memory", False)
    settings = {"device": tier, "buffer_count": 3, "pin_memory": False,
                **({"nvme_path": str(tmp_path)} if tier == "nvme" else {})}
    report = offload_model(engine.module, settings, engine.accelerator, engine.device,
                           engine.plan)
    try:
        loader = report.ring.loader
        assert isinstance(loader, DeviceLoader) and report.tier == tier
        assert (report.path is not None) == (tier == "nvme")
        assert torch.equal(engine.generate(ids, **GREEDY), ref_tokens)
        report.ring.settle()  # the last release's prefetch may still be copying
        stats = report.stats()
        assert stats["units_read"] == len(report.units) and loader.copies >= NEW_TOKENS
        ranges = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in loader.slots]
        assert all(_in_slots(t, ranges) for t in _unit_tensors(engine))
        # every copy waited for its slot's last compute and was waited for; releases recorded
        free, copied = ({e.id for e in events} for events in (loader.free, loader.copied))
        waits = [i for kind, i in log if kind == "wait"]
        assert len(waits) == loader.copies and set(waits) <= free
        assert sum(kind == "synchronize" and i in copied for kind, i in log) == loader.copies
        assert sum(kind == "record" and i in free for kind, i in log) >= loader.copies - 3
    finally:
        report.close()


# ----- the store ---------------------------------------------------------------------------------


def _files(path: Path) -> dict[str, int]:
    return {str(p.relative_to(path)): p.stat().st_mtime_ns for p in path.rglob("*") if p.is_file()}


def test_a_second_init_reuses_the_store_and_another_model_does_not(tmp_path):
    ids = prompt_ids(batch=2, length=8)
    ref_tokens = tiny_causal_lm("llama").generate(ids, **GREEDY)
    first = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu", dtype=torch.float32,
                                     offload=_offload(tmp_path))
    assert not first.offload.reused and not first.offload.stale
    written = _files(tmp_path)
    second = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                      dtype=torch.float32, offload=_offload(tmp_path))
    assert second.offload.reused and second.offload.path == first.offload.path
    assert _files(tmp_path) == written, "a reused store was written to"
    assert torch.equal(second.generate(ids, **GREEDY), ref_tokens)
    other = shardwise.init_inference(tiny_causal_lm("llama", seed=1), device="cpu",
                                     dtype=torch.float32, offload=_offload(tmp_path))
    assert not other.offload.reused and other.offload.path != first.offload.path
    assert other.offload.stale == [first.offload.path]
    other_ref = tiny_causal_lm("llama", seed=1).generate(ids, **GREEDY)
    assert torch.equal(other.generate(ids, **GREEDY), other_ref)
    # the settings are in the key too: the same weights injected get their own store
    injected = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                        dtype=torch.float32, replace_with_kernel_inject=True,
                                        offload=_offload(tmp_path))
    assert not injected.offload.reused and injected.offload.path not in (first.offload.path,
                                                                         other.offload.path)


def test_the_init_log_says_the_ring_size(tmp_path, caplog):
    with caplog.at_level("INFO", logger="shardwise"):
        engine = shardwise.init_inference(tiny_causal_lm("llama"), device="cpu",
                                          dtype=torch.float32, offload=_offload(tmp_path, 3))
    report = engine.offload
    slot = max(os.path.getsize(p) for p in Path(report.path).glob("unit-*"))
    assert report.ring_bytes == 3 * slot
    line = next(r.getMessage() for r in caplog.records if "offload (nvme)" in r.getMessage())
    assert report.summary() in line
    assert report.ring_bytes < 2**20  # a tiny model's ring is shown in KiB
    assert f"ring of 3 slots = {report.ring_bytes / 2**10:.1f} KiB" in line
    assert "resident" in line and str(report.path) in line


# ----- close -------------------------------------------------------------------------------------


@pytest.mark.parametrize("inject", [False, True])
def test_close_gives_back_a_model_that_generates_the_same(inject, tmp_path):
    ids = prompt_ids(batch=2, length=8)
    ref_tokens = tiny_causal_lm("llama").generate(ids, **GREEDY)
    model = tiny_causal_lm("llama")
    names = [n for n, _ in model.named_parameters()]
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                      replace_with_kernel_inject=inject,
                                      offload=_offload(tmp_path))
    assert torch.equal(engine.generate(ids, **GREEDY), ref_tokens)
    ranges = _slot_ranges(engine)
    back = engine.close()
    assert back is model and [n for n, _ in back.named_parameters()] == names
    assert not any(_in_slots(p, ranges) for p in back.parameters())
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in back.modules())
    assert engine.offload.ring.closed
    with torch.no_grad():
        assert torch.equal(back.generate(ids, **GREEDY), ref_tokens)
        assert torch.equal(back(ids).logits, tiny_causal_lm("llama")(ids).logits)


def test_a_quantized_engine_closes_like_its_resident_twin(tmp_path):
    ids = prompt_ids(batch=2, length=8)
    settings = _settings(True, 8)
    resident = shardwise.init_inference(tiny_causal_lm("llama"), **settings)
    engine = shardwise.init_inference(tiny_causal_lm("llama"), offload=_offload(tmp_path),
                                      **settings)
    assert torch.equal(engine.generate(ids, **GREEDY), resident.generate(ids, **GREEDY))
    mine, theirs = engine.close(), resident.close()  # both dequantized from the same bytes
    with torch.no_grad():
        assert torch.equal(mine(ids).logits, theirs(ids).logits)


def test_a_failed_init_after_the_repack_gives_the_model_back(tmp_path, monkeypatch):
    from shardwise.offload import transform

    model = tiny_causal_lm("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = dict(model.named_parameters())
    rings = []
    real_ring = transform.Ring

    def failing_hooks(units, ring):
        rings.append(ring)
        raise RuntimeError("injected failure after the weights were freed")
    monkeypatch.setattr(transform, "_install_hooks", failing_hooks)
    monkeypatch.setattr(transform, "Ring", real_ring)
    with pytest.raises(RuntimeError, match="injected failure"):
        shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                 offload=_offload(tmp_path))
    assert rings and rings[0].closed
    slots = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in rings[0].loader.slots]
    for name, p in model.named_parameters():
        assert p is params[name] and torch.equal(p, before[name]), name
        assert not _in_slots(p, slots), name
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_saving_a_checkpoint_is_refused_at_init_and_on_the_engine(tmp_path):
    model = tiny_causal_lm("llama")
    with pytest.raises(shardwise.ConfigError, match="offloaded engine cannot save"):
        shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                 offload=_offload(tmp_path),
                                 save_mp_checkpoint_path=str(tmp_path / "ckpt"))
    assert not list(tmp_path.iterdir()), "refused after writing"
    engine = shardwise.init_inference(model, device="cpu", dtype=torch.float32,
                                      offload=_offload(tmp_path))
    with pytest.raises(shardwise.ConfigError, match="offloaded engine cannot save"):
        engine.save_checkpoint(tmp_path / "ckpt")


# ----- tensor parallelism ------------------------------------------------------------------------


def _tp_case(rank: int, arch: str, inject: bool, bits: int | None, store: str) -> dict:
    os.makedirs(store, exist_ok=True)  # this case's own: the two ranks' stores side by side
    ids = prompt_ids(batch=2, length=8)
    settings = _settings(inject, bits)
    resident = shardwise.init_inference(tiny_causal_lm(arch), **settings, **TP)
    mine = ids if rank == 0 else torch.zeros_like(ids)  # the engine broadcasts rank 0's inputs
    ref_logits = resident(input_ids=mine).logits
    ref_tokens = resident.generate(mine, **GREEDY)
    engine = shardwise.init_inference(tiny_causal_lm(arch), offload=_offload(store, 2),
                                      **settings, **TP)
    logits = engine(input_ids=mine).logits
    tokens = engine.generate(mine, **GREEDY)
    whole = tiny_causal_lm(arch)  # one process's whole model: what one rank would stream alone
    whole_bytes = sum(r.current().numel() * r.current().element_size()
                      for u in offload_units(whole, engine.plan) for r in u.tensors)
    ranges = _slot_ranges(engine)
    stats = engine.offload.stats()
    return dict(max_abs=(logits - ref_logits).abs().max().item(),
                tokens_equal=torch.equal(tokens, ref_tokens), tokens=tokens.tolist(),
                streamed=engine.offload.streamed_bytes_per_pass, whole=whole_bytes,
                path=engine.offload.path, units_read=stats["units_read"],
                units=len(engine.offload.units), stale=engine.offload.stale,
                in_slots=all(_in_slots(t, ranges) for t in _unit_tensors(engine)))


TP_TABLE = {"llama": ("llama", False, None), "llama-inject": ("llama", True, None),
            "gpt2": ("gpt2", False, None), "llama-inject-int8": ("llama", True, 8)}


tp_ranks = table_fixture(_tp_case, TP_TABLE, "offload-tp", deadline_s=300, case_dirs=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TP_TABLE))
def test_tp2_each_rank_streams_its_shard_and_matches_resident_tp(tp_ranks, name):
    r0, r1 = case(tp_ranks, name)
    for r in (r0, r1):
        assert r["max_abs"] <= ATOL and r["tokens_equal"], r
        assert r["units_read"] == r["units"] and r["in_slots"]
        # sharded layers: each rank's blobs hold its half of the split weights, not the model
        assert r["streamed"] < 0.8 * r["whole"], (r["streamed"], r["whole"])
    assert r0["tokens"] == r1["tokens"]
    assert r0["path"] != r1["path"], "the ranks share one store: each must stream its own shard"
    assert r0["stale"] == r1["stale"] == [], "a rank's store counted as stale by the other"
