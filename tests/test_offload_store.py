"""Offload blob store: aligned layout, disk round trips, direct I/O and its fall back, stale
stores, damage detection, the read probe (shardwise.offload.store)."""

import errno
import gc
import json
import os
import threading

import pytest
import torch

from shardwise.offload import store as st
from shardwise.offload.store import (
    ALIGN,
    MANIFEST,
    BlobReader,
    DiskStore,
    MemoryStore,
    UnitEntry,
    aligned_host_buffer,
    content_digest,
    fingerprint_key,
    layout_unit,
    pack_into,
    read_probe,
    required_bytes,
    unit_views,
)

FP = {"model": "tiny", "dtype": torch.float32, "quant": None, "rank": 0}


def _tensors(seed: int) -> list[tuple[str, torch.Tensor]]:
    """A unit's tensors: several dtypes, a 0-dim, odd sizes, an empty one, a non-contiguous one."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("attn.q.weight", torch.randn(8, 6, generator=g)),                                 # fp32
        ("attn.scale", torch.tensor(0.125 + seed)),                                        # 0-dim
        ("mlp.up.weight", torch.randn(5, 7, generator=g).to(torch.bfloat16)),              # odd
        ("mlp.q8", torch.randint(-128, 128, (3, 1001), generator=g, dtype=torch.int8)),    # odd
        ("mlp.packed", torch.randint(0, 256, (13,), generator=g, dtype=torch.uint8)),
        ("empty", torch.empty(0, 4)),
        ("transposed", torch.randn(4, 9, generator=g).t()),                               # strided
    ]


def _units(n: int = 3) -> tuple[list[UnitEntry], list[list[torch.Tensor]]]:
    """``n`` laid-out units and their values (distinct per unit)."""
    entries, values = [], []
    for i in range(n):
        named = _tensors(i)
        entries.append(layout_unit(i, f"model.layers.{i}", named))
        values.append([t for _, t in named])
    return entries, values


def _written_store(root, n: int = 3, fingerprint=FP):
    """A finished DiskStore of ``n`` units under ``root``."""
    entries, values = _units(n)
    store = DiskStore(root, fingerprint)
    for e, v in zip(entries, values):
        store.write_unit(e, v)
    store.finish(entries)
    return store, entries, values


def _assert_unit_equal(entry, buffer, values):
    """The views of ``buffer`` equal ``values`` bit for bit, with the entry's dtypes/shapes."""
    views = unit_views(entry, buffer)
    for te, want in zip(entry.tensors, values):
        got = views[te.key]
        assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), te.key
        assert torch.equal(got, want), te.key


# ------------------------------------------------------------------------------------- layout


def test_layout_aligns_every_offset_and_length():
    entries, values = _units(3)
    for e, v in zip(entries, values):
        assert e.nbytes % ALIGN == 0
        ends = 0
        for te, t in zip(e.tensors, v):
            assert te.offset % ALIGN == 0
            assert te.offset >= ends  # in order, no overlap
            assert te.nbytes == t.numel() * t.element_size()
            ends = te.offset + te.nbytes
        assert e.nbytes >= ends and e.nbytes - ends < ALIGN


def test_layout_of_meta_tensors_matches_real_ones():
    named = _tensors(0)
    meta = [(k, torch.empty(t.shape, dtype=t.dtype, device="meta")) for k, t in named]
    assert layout_unit(2, "u", meta) == layout_unit(2, "u", named)


def test_entry_json_round_trip_through_text():
    entries, _ = _units(2)
    for e in entries:
        assert UnitEntry.from_json(json.loads(json.dumps(e.to_json()))) == e


def test_unknown_dtype_in_manifest_is_a_clear_error():
    d = layout_unit(0, "u", [("w", torch.zeros(2))]).to_json()
    d["tensors"][0]["dtype"] = "float128"
    with pytest.raises(ValueError, match="float128.*repacked"):
        UnitEntry.from_json(d)


def test_duplicate_keys_are_refused():
    with pytest.raises(ValueError, match="'w' appears twice"):
        layout_unit(0, "u", [("w", torch.zeros(2)), ("w", torch.zeros(3))])


def test_required_bytes_covers_the_blobs():
    entries, _ = _units(3)
    assert required_bytes(entries) >= sum(e.nbytes for e in entries) + 3 * ALIGN


# ------------------------------------------------------------------------------- host buffers


def _pinner(calls, misaligned: bool):
    """A stand-in for an accelerator's pinned_host_buffer, recording each size asked for: CPU
    memory whose address is a multiple of ALIGN, or (``misaligned``) 8 bytes past one (so the
    slicing is exercised). Dirty: the buffer must come back zeroed."""
    def pinned(nbytes):
        calls.append(nbytes)
        raw = torch.empty(nbytes + ALIGN + 8, dtype=torch.uint8)
        skip = (-raw.data_ptr()) % ALIGN + (8 if misaligned else 0)
        return raw[skip:skip + nbytes].fill_(1)
    return pinned


@pytest.mark.parametrize("nbytes", [0, 1, ALIGN - 1, ALIGN, 3 * ALIGN + 5, 5 << 20])
@pytest.mark.parametrize("pin", [None, "aligned", "misaligned"])
def test_aligned_host_buffer(nbytes, pin):
    calls = []
    buf = aligned_host_buffer(nbytes, _pinner(calls, pin == "misaligned") if pin else None)
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.device.type == "cpu"
    assert buf.numel() == -(-nbytes // ALIGN) * ALIGN
    assert buf.data_ptr() % ALIGN == 0
    assert int(buf.count_nonzero()) == 0
    # the exact size first; one page more only when that block was not aligned (an empty
    # block has no address to misalign)
    again = [buf.numel() + ALIGN] if nbytes else []
    expected = {None: [], "aligned": [buf.numel()], "misaligned": [buf.numel(), *again]}[pin]
    assert calls == expected
    if nbytes:
        buf[-1] = 7  # writable to its last byte
        assert int(buf[-1]) == 7


def test_a_device_computing_in_host_memory_pins_nothing():
    from shardwise.accelerators.cpu import CpuAccelerator

    assert CpuAccelerator().pinned_host_buffer(ALIGN) is None
    buf = aligned_host_buffer(ALIGN, CpuAccelerator().pinned_host_buffer)  # pageable mmap
    assert buf.numel() == ALIGN and not buf.is_pinned()


class _FakeRuntime:
    """Stands in for torch.cuda.cudart(): records host (un)registrations."""

    class cudaError:  # noqa: N801 (the runtime's name)
        success = 0

    def __init__(self, status: int = 0):
        self.calls, self.status = [], status

    def cudaHostRegister(self, address, size, flags):  # noqa: N802
        self.calls.append(("register", address, size, flags))
        return self.status

    def cudaHostUnregister(self, address):  # noqa: N802
        self.calls.append(("unregister", address))
        return 0


def test_registered_pinned_buffer_is_exact_and_unregistered_when_freed():
    runtime = _FakeRuntime()
    buf = st.registered_host_buffer(3 * ALIGN, runtime)
    address = buf.data_ptr()
    assert buf.numel() == 3 * ALIGN and address % ALIGN == 0
    assert runtime.calls == [("register", address, 3 * ALIGN, 0)]  # exactly the bytes asked for
    buf.fill_(5)
    view = buf[ALIGN:]
    del buf
    gc.collect()
    assert len(runtime.calls) == 1  # a view still uses the memory: still registered and mapped
    assert int(view[-1]) == 5
    del view
    gc.collect()
    assert runtime.calls[-1] == ("unregister", address)


def test_refused_pinning_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"ulimit -l.*pin_memory=False"):
        st.registered_host_buffer(ALIGN, _FakeRuntime(status=2))


def test_views_are_zero_copy_into_the_buffer():
    entry = layout_unit(0, "u", _tensors(1))
    buf = aligned_host_buffer(entry.nbytes)
    views = unit_views(entry, buf)
    base = buf.data_ptr()
    for te in entry.tensors:
        v = views[te.key]
        if te.nbytes == 0:
            assert v.numel() == 0  # torch reports address 0 for an empty tensor
            continue
        assert v.data_ptr() == base + te.offset
        assert v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    # a write through the buffer shows in the view, and back
    off = entry.tensors[0].offset
    buf[off:off + 4] = torch.tensor([0.0, 0.0, 128.0, 63.0]).to(torch.uint8)  # 1.0 in fp32 (LE)
    assert views["attn.q.weight"][0, 0].item() == 1.0
    views["mlp.packed"].fill_(9)
    off = entry.tensors[4].offset
    assert torch.all(buf[off:off + 13] == 9)


def test_pack_zeroes_padding_and_round_trips():
    named = _tensors(3)
    entry = layout_unit(0, "u", named)
    buf = aligned_host_buffer(entry.nbytes)
    buf.fill_(0xFF)  # padding must not keep old bytes
    pack_into(entry, [t for _, t in named], buf)
    _assert_unit_equal(entry, buf, [t for _, t in named])
    covered = torch.zeros(entry.nbytes, dtype=torch.bool)
    for te in entry.tensors:
        covered[te.offset:te.offset + te.nbytes] = True
    assert int(buf[~covered].count_nonzero()) == 0


def test_pack_refuses_mismatched_values():
    named = _tensors(0)
    entry = layout_unit(0, "u", named)
    buf = aligned_host_buffer(entry.nbytes)
    values = [t for _, t in named]
    with pytest.raises(ValueError, match="'attn.q.weight' is torch.float16"):
        pack_into(entry, [values[0].half()] + values[1:], buf)
    with pytest.raises(ValueError, match="6 tensors given, the layout has 7"):
        pack_into(entry, values[:-1], buf)
    with pytest.raises(ValueError, match=f"holds {ALIGN} bytes"):
        pack_into(entry, values, aligned_host_buffer(ALIGN))


def test_unit_views_refuse_a_wrong_buffer():
    entry = layout_unit(0, "u", _tensors(0))
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        unit_views(entry, torch.zeros(entry.nbytes // 4, dtype=torch.float32))


def test_memory_store_round_trip():
    entries, values = _units(2)
    mem = MemoryStore()
    for e, v in zip(entries, values):
        mem.write_unit(e, v)
    for e, v in zip(entries, values):
        buf = mem.buffer(e)
        assert buf.data_ptr() % ALIGN == 0 and buf.numel() == e.nbytes
        _assert_unit_equal(e, buf, v)
    assert mem.nbytes == sum(e.nbytes for e in entries)
    with pytest.raises(KeyError, match="never written"):
        mem.buffer(UnitEntry(9, "model.layers.9", 0, ()))


# -------------------------------------------------------------------------------- fingerprints


def test_fingerprint_key_is_stable_and_order_free():
    a = fingerprint_key({"x": 1, "y": [1, 2], "dtype": torch.bfloat16})
    b = fingerprint_key({"dtype": torch.bfloat16, "y": [1, 2], "x": 1})
    assert a == b and len(a) == 16
    assert fingerprint_key({"x": 2, "y": [1, 2], "dtype": torch.bfloat16}) != a


def test_content_digest_sees_values_dtypes_and_shapes():
    w = torch.randn(64, 33)
    base = content_digest([w, torch.tensor(3)])
    assert content_digest([w.clone(), torch.tensor(3)]) == base
    changed = w.clone()
    changed[0, 0] += 1  # the first element is always sampled
    assert content_digest([changed, torch.tensor(3)]) != base
    assert content_digest([w.reshape(33, 64), torch.tensor(3)]) != base
    assert content_digest([w.double(), torch.tensor(3)]) != base
    assert content_digest([torch.empty(64, 33, device="meta"), torch.tensor(3)]) != base


# -------------------------------------------------------------------------------- disk store


def test_disk_round_trip_direct(tmp_path):
    store, entries, values = _written_store(tmp_path)
    assert store.path == tmp_path / fingerprint_key(FP)
    assert store.complete(entries)
    for e in entries:
        assert store.unit_path(e).stat().st_size == e.nbytes
    with store.reader(threads=2) as reader:
        assert reader.direct_io, reader.fallback_reason  # /tmp here is ext4
        for e, v in zip(entries, values):
            buf = aligned_host_buffer(e.nbytes)
            seconds = reader.submit(e, buf).result()
            assert seconds > 0
            _assert_unit_equal(e, buf, v)


def test_file_bytes_are_the_packed_blob(tmp_path):
    store, entries, values = _written_store(tmp_path, n=1)
    buf = aligned_host_buffer(entries[0].nbytes)
    pack_into(entries[0], values[0], buf)
    assert store.unit_path(entries[0]).read_bytes() == bytes(buf.tolist())


def test_write_packed_from_views_filled_one_by_one(tmp_path):
    named = _tensors(5)
    entry = layout_unit(0, "model.layers.0", named)
    buf = aligned_host_buffer(entry.nbytes)  # zeroed: the padding is zero already
    for key, value in named:  # as a checkpoint streams tensors in
        unit_views(entry, buf)[key].copy_(value)
    store = DiskStore(tmp_path, FP)
    store.write_packed(entry, buf)
    store.finish([entry])
    assert store.complete([entry])
    with store.reader() as reader:
        back = aligned_host_buffer(entry.nbytes)
        reader.submit(entry, back).result()
    assert torch.equal(back, buf)
    with pytest.raises(ValueError, match="needs"):
        store.write_packed(entry, buf[:ALIGN])


def test_direct_and_buffered_reads_give_identical_bytes(tmp_path):
    store, entries, _ = _written_store(tmp_path)
    with store.reader(direct=True) as direct, store.reader(direct=False) as buffered:
        assert direct.direct_io and not buffered.direct_io
        assert buffered.fallback_reason is None  # not asked for: nothing fell back
        for e in entries:
            a, b = aligned_host_buffer(e.nbytes), aligned_host_buffer(e.nbytes)
            a.fill_(1), b.fill_(2)
            direct.submit(e, a).result()
            buffered.submit(e, b).result()
            assert torch.equal(a, b)


def test_concurrent_submits_of_several_units(tmp_path, monkeypatch):
    monkeypatch.setattr(st, "CHUNK", ALIGN)  # many chunks per unit: reads interleave
    store, entries, values = _written_store(tmp_path, n=6)
    slot = max(e.nbytes for e in entries)
    ring = aligned_host_buffer(slot * len(entries))  # one slot per unit, each ALIGN-aligned
    with store.reader(threads=3) as reader:
        futures = [reader.submit(e, ring[i * slot:(i + 1) * slot]) for i, e in enumerate(entries)]
        assert all(f.result(timeout=30) > 0 for f in futures)
    for i, (e, v) in enumerate(zip(entries, values)):
        _assert_unit_equal(e, ring[i * slot:(i + 1) * slot], v)


def test_reads_run_on_several_threads_at_once(tmp_path, monkeypatch):
    store, entries, values = _written_store(tmp_path, n=3)
    real_preadv = os.preadv
    together = threading.Barrier(3, timeout=20)  # broken unless 3 reads are in flight at once

    def meeting_preadv(fd, buffers, offset, *args):
        if offset == 0:
            together.wait()
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", meeting_preadv)
    bufs = [aligned_host_buffer(e.nbytes) for e in entries]
    with BlobReader(store.path, threads=3) as reader:
        futures = [reader.submit(e, b) for e, b in zip(entries, bufs)]
        for f in futures:
            f.result(timeout=30)
    for e, b, v in zip(entries, bufs, values):
        _assert_unit_equal(e, b, v)


def test_submit_refuses_a_bad_destination(tmp_path):
    store, entries, _ = _written_store(tmp_path, n=1)
    e = entries[0]
    with store.reader() as reader:
        misaligned = aligned_host_buffer(e.nbytes + ALIGN)[1:1 + e.nbytes]
        with pytest.raises(ValueError, match="multiple of 4096"):
            reader.submit(e, misaligned)
        with pytest.raises(ValueError, match="needs"):
            reader.submit(e, aligned_host_buffer(e.nbytes - ALIGN))


def test_truncated_file_is_not_complete_and_its_read_names_it(tmp_path):
    store, entries, _ = _written_store(tmp_path)
    victim = store.unit_path(entries[1])
    os.truncate(victim, entries[1].nbytes - ALIGN)
    assert not store.complete(entries)
    with store.reader() as reader:
        buf = aligned_host_buffer(entries[1].nbytes)
        with pytest.raises(OSError, match="damaged") as info:
            reader.submit(entries[1], buf).result()
        assert info.value.filename == str(victim)
        assert str(victim) in str(info.value)
        reader.submit(entries[0], buf).result()  # the others still read


def test_missing_file_is_not_complete_and_its_read_names_it(tmp_path):
    store, entries, _ = _written_store(tmp_path)
    victim = store.unit_path(entries[2])
    victim.unlink()
    assert not store.complete(entries)
    with store.reader() as reader:
        with pytest.raises(OSError) as info:
            reader.submit(entries[2], aligned_host_buffer(entries[2].nbytes)).result()
        assert info.value.errno == errno.ENOENT and str(victim) in str(info.value)


def test_complete_needs_the_same_entries_and_manifest(tmp_path):
    store, entries, _ = _written_store(tmp_path)
    assert store.complete(entries)
    assert not store.complete(entries[:2])  # another model's unit list
    other = layout_unit(0, entries[0].name, [("w", torch.zeros(3))])
    assert not store.complete([other] + entries[1:])
    (store.path / MANIFEST).write_text("{not json")
    assert not store.complete(entries)
    (store.path / MANIFEST).unlink()
    assert not store.complete(entries)
    # a fresh DiskStore object over the same directory sees the same thing
    assert not DiskStore(tmp_path, FP).complete(entries)


def test_rewrite_drops_the_manifest_before_the_first_unit(tmp_path):
    store, entries, values = _written_store(tmp_path)
    again = DiskStore(tmp_path, FP)
    assert again.complete(entries)
    again.write_unit(entries[0], values[0])
    assert not again.complete(entries)  # half rewritten: never looks complete
    for e, v in zip(entries[1:], values[1:]):
        again.write_unit(e, v)
    again.finish(entries)
    assert again.complete(entries)
    assert not list(again.path.glob("*.tmp"))  # temp files renamed or removed


def test_an_interrupted_write_leaves_no_temp_files_behind(tmp_path):
    store, entries, values = _written_store(tmp_path)
    leftover = store.path / ".unit-00001.bin.abc123.tmp"  # a crash between write and rename
    leftover.write_bytes(b"partial")
    again = DiskStore(tmp_path, FP)
    again.write_unit(entries[1], values[1])
    assert not leftover.exists()


def test_finish_refuses_an_unwritten_unit(tmp_path):
    entries, values = _units(2)
    store = DiskStore(tmp_path, FP)
    store.write_unit(entries[0], values[0])
    with pytest.raises(OSError, match="'model.layers.1' was not fully written"):
        store.finish(entries)
    assert not (store.path / MANIFEST).exists()


def test_constructing_a_store_writes_nothing(tmp_path):
    DiskStore(tmp_path, FP)
    assert list(tmp_path.iterdir()) == []


def test_changed_fingerprint_gets_a_new_dir_and_lists_the_old_as_stale(tmp_path):
    old, entries, values = _written_store(tmp_path)
    (tmp_path / "unrelated").mkdir()  # not a store: never listed
    new = DiskStore(tmp_path, {**FP, "quant": "int8"})
    assert new.path != old.path and new.path.parent == tmp_path
    assert new.stale == [old.path]
    assert not new.complete(entries)
    for e, v in zip(entries, values):
        new.write_unit(e, v)
    new.finish(entries)
    assert new.complete(entries) and old.complete(entries)  # the old one is left alone
    assert DiskStore(tmp_path, FP).stale == [new.path]


def test_an_unfinished_store_of_another_fingerprint_is_stale_too(tmp_path):
    entries, values = _units(1)
    half = DiskStore(tmp_path, FP)
    half.write_unit(entries[0], values[0])  # interrupted before finish()
    assert DiskStore(tmp_path, {**FP, "rank": 1}).stale == [half.path]


def test_shards_of_one_model_are_not_stale_to_each_other(tmp_path):
    entries, values = _units(2)
    ranks = [DiskStore(tmp_path, FP, shard={"tp": [2, r]}) for r in range(2)]
    for store in ranks:
        for e, v in zip(entries, values):
            store.write_unit(e, v)
        store.finish(entries)
    assert ranks[0].group == ranks[1].group == tmp_path / fingerprint_key(FP)
    assert ranks[0].path != ranks[1].path and ranks[0].path.parent == ranks[0].group
    for r in range(2):
        again = DiskStore(tmp_path, FP, shard={"tp": [2, r]})
        assert again.stale == [] and again.complete(entries)
    assert not DiskStore(tmp_path, FP).complete(entries)  # the unsharded store is another one
    # a manifest moved to another shard's directory is not that shard's
    (ranks[1].path / MANIFEST).write_bytes((ranks[0].path / MANIFEST).read_bytes())
    assert not DiskStore(tmp_path, FP, shard={"tp": [2, 1]}).complete(entries)
    # another model sees the whole group as one stale store
    assert DiskStore(tmp_path, {**FP, "model": "other"}).stale == [ranks[0].group]


def test_a_manifest_that_is_not_an_object_is_not_complete(tmp_path):
    store, entries, _ = _written_store(tmp_path)
    (store.path / MANIFEST).write_text("[1, 2]")
    assert not store.complete(entries)


def test_writing_into_a_missing_root_says_so(tmp_path):
    entries, values = _units(1)
    store = DiskStore(tmp_path / "nope", FP)
    assert store.stale == []
    with pytest.raises(FileNotFoundError, match="nvme_path"):
        store.write_unit(entries[0], values[0])


# ---------------------------------------------------------------------- O_DIRECT fall back


def _refuse_direct_open(monkeypatch):
    """Make os.open refuse O_DIRECT with EINVAL, as tmpfs and some filesystems do."""
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", fake_open)


def _refuse_direct_read(monkeypatch):
    """Make preadv fail with EINVAL on files opened with O_DIRECT (open itself succeeds)."""
    real_open, real_preadv, direct_fds = os.open, os.preadv, set()

    def fake_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        (direct_fds.add if flags & os.O_DIRECT else direct_fds.discard)(fd)
        return fd

    def fake_preadv(fd, buffers, offset, *args):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "preadv", fake_preadv)


@pytest.mark.parametrize("refuse", [_refuse_direct_open, _refuse_direct_read], ids=["open", "read"])
def test_refused_direct_io_falls_back_and_says_why(tmp_path, monkeypatch, refuse):
    store, entries, values = _written_store(tmp_path)
    refuse(monkeypatch)
    with store.reader(threads=2) as reader:  # probes the first file: settles direct_io now
        assert not reader.direct_io
        assert "O_DIRECT" in reader.fallback_reason and "page cache" in reader.fallback_reason
        for e, v in zip(entries, values):
            buf = aligned_host_buffer(e.nbytes)
            reader.submit(e, buf).result()
            _assert_unit_equal(e, buf, v)


def test_fall_back_during_a_read_when_nothing_was_probed(tmp_path, monkeypatch):
    store, entries, values = _written_store(tmp_path)
    _refuse_direct_read(monkeypatch)
    with BlobReader(store.path, threads=1) as reader:
        assert reader.direct_io  # not known until the first read
        buf = aligned_host_buffer(entries[0].nbytes)
        reader.submit(entries[0], buf).result()
        assert not reader.direct_io and "read failed" in reader.fallback_reason
        _assert_unit_equal(entries[0], buf, values[0])


def test_other_read_errors_do_not_fall_back(tmp_path, monkeypatch):
    store, entries, _ = _written_store(tmp_path)
    real_preadv = os.preadv

    def failing_preadv(fd, buffers, offset, *args):
        if offset > 0:
            raise OSError(errno.EIO, "Input/output error")
        return real_preadv(fd, buffers, offset, *args)

    monkeypatch.setattr(st, "CHUNK", ALIGN)
    monkeypatch.setattr(os, "preadv", failing_preadv)
    with BlobReader(store.path) as reader:
        with pytest.raises(OSError, match="reading at byte 4096") as info:
            reader.submit(entries[0], aligned_host_buffer(entries[0].nbytes)).result()
        assert info.value.errno == errno.EIO
        assert info.value.filename == str(store.unit_path(entries[0]))
        assert reader.direct_io and reader.fallback_reason is None


# ------------------------------------------------------------------------------- read probe


def test_read_probe_measures_and_cleans_up(tmp_path):
    result = read_probe(tmp_path, nbytes=8 << 20, threads=2)
    assert result["gbps"] > 0 and result["seconds"] > 0
    assert result["nbytes"] == 8 << 20
    assert result["direct_io"] is True and result["fallback_reason"] is None
    assert result["gbps"] == pytest.approx(result["nbytes"] / result["seconds"] / 1e9)
    assert list(tmp_path.iterdir()) == []


def test_read_probe_reports_a_fall_back(tmp_path, monkeypatch):
    _refuse_direct_open(monkeypatch)
    result = read_probe(tmp_path, nbytes=1 << 20, threads=1)
    assert result["gbps"] > 0 and result["direct_io"] is False
    assert "O_DIRECT open failed" in result["fallback_reason"]
    assert list(tmp_path.iterdir()) == []


def test_read_probe_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="nbytes and threads must be >= 1"):
        read_probe(tmp_path, nbytes=0)
    with pytest.raises(ValueError, match="nbytes and threads must be >= 1"):
        read_probe(tmp_path, nbytes=ALIGN, threads=0)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        read_probe(tmp_path / "missing", nbytes=ALIGN)
    assert list(tmp_path.iterdir()) == []


def test_content_digest_samples_tensors_beyond_float32_exact_indices():
    """A tensor of more than 2**24 elements (GPT-2's 50257 x 1024 embedding has 51.5M): the
    sample indices stay inside it, the last element is sampled, and changing it changes the
    digest."""
    t = torch.zeros((1 << 24) + 3, dtype=torch.uint8)
    before = st.content_digest([t])
    t[-1] = 7
    assert st.content_digest([t]) != before
