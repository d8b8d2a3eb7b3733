"""benchmarks/serve_load.py's own failure paths (no model, no server): a level whose client
processes never report ends in an error naming the level, not a bare ``queue.Empty``."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "serve_load.py"


@pytest.fixture(scope="module")
def serve_load():
    spec = importlib.util.spec_from_file_location("serve_load_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_a_level_whose_clients_never_report_is_a_timeout_naming_the_level(serve_load,
                                                                          monkeypatch):
    monkeypatch.setattr(serve_load, "LEVEL_TIMEOUT_S", 0.25)
    clients = serve_load.Clients(2)  # not entered: no client process runs, none reports
    served = serve_load.Served("shardwise", None, types.SimpleNamespace(url="http://127.0.0.1:9"),
                               "m")
    try:
        with pytest.raises(TimeoutError) as excinfo:
            clients.run(served, ["a prompt"], 8, 3, 16)
    finally:
        for q in clients._jobs:
            q.cancel_join_thread()
    message = str(excinfo.value)
    assert "shardwise at 8 streams x 3 requests of 16 tokens" in message
    assert "2 of 2 client processes sent no result within 0.25 s" in message


def test_prefill_stall_reaches_the_scheduler_and_a_bad_one_is_refused(serve_load, monkeypatch,
                                                                      capsys):
    with pytest.raises(SystemExit):
        serve_load.parse_args(["--prefill-stall", "0"])
    assert "--prefill-stall must be > 0" in capsys.readouterr().err
    seen = {}
    monkeypatch.setattr("shardwise.serve.server.build_stack",
                        lambda *args, **kwargs: seen.update(kwargs))
    accelerator = types.SimpleNamespace(preferred_dtype=None)
    serve_load.shardwise_stack(None, None, serve_load.parse_args(["--prefill-stall", "0.4"]),
                               accelerator, "m")
    assert seen["prefill_stall"] == 0.4
    seen.clear()
    serve_load.shardwise_stack(None, None, serve_load.parse_args([]), accelerator, "m")
    assert "prefill_stall" not in seen  # the server's default
    assert "quant" not in seen and seen["enable_graph"] and seen["replace_with_kernel_inject"]
    seen.clear()
    serve_load.shardwise_stack(None, None, serve_load.parse_args(["--quant", "int4"]),
                               accelerator, "m")
    assert seen["quant"]["weight"]["num_bits"] == 4  # as `shardwise serve --quant int4`


def test_the_server_freezes_what_start_up_left_alive():
    import gc

    from shardwise.serve.server import freeze_startup_objects

    class Cycle:  # garbage of start-up: collected first, not frozen
        pass

    before = gc.get_freeze_count()
    kept, dropped = Cycle(), Cycle()
    dropped.me = dropped
    probe = __import__("weakref").ref(dropped)
    del dropped
    try:
        frozen = freeze_startup_objects()
        assert probe() is None  # the cycle was collected before the freeze
        # frozen objects freed since (other threads of a long test process) leave the count
        assert frozen > before and gc.get_freeze_count() > before
        assert not any(o is kept for o in gc.get_objects())  # out of the generations
    finally:
        gc.unfreeze()
