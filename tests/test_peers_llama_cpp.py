"""benchmarks/peers/llama_cpp.py: the warm-up runs every timed call once (the batched decode
included, so no timed run holds a batch bucket's compile) and the batched tokens/s by median
step. Fakes stand in for both engines: nothing is loaded or compiled."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "llama_cpp.py"


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("peers_llama_cpp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


class _Args:
    def __init__(self, batch: int, new_tokens: int = 4) -> None:
        self.batch, self.new_tokens = batch, new_tokens


def _recorder(base):
    class Recorder(base):
        def __init__(self):  # no engine behind it
            self.calls = []

        def generate(self, prompt, new_tokens):
            self.calls.append(("generate", len(prompt), new_tokens))

        def generate_batch(self, prompt, new_tokens, *batch):
            self.calls.append(("batch", len(prompt), new_tokens, *batch))
    return Recorder()


@pytest.mark.parametrize("kind", ["shardwise", "llama_cpp"])
def test_warm_up_runs_the_batched_decode(peers, kind):
    base = peers.ShardwiseVariant if kind == "shardwise" else peers.LlamaCppVariant
    variant = _recorder(base)
    peers.warm_up(variant, [1] * 8, [2] * 32, _Args(batch=8))
    assert variant.calls[0] == ("generate", 8, 4)
    assert variant.calls[1] == ("generate", 32, 1)
    batch_args = (8,) if kind == "shardwise" else ()
    assert variant.calls[2] == ("batch", 8, 2, *batch_args)
    assert len(variant.calls) == 3


def test_warm_up_skips_what_is_not_timed(peers):
    variant = _recorder(peers.ShardwiseVariant)
    peers.warm_up(variant, [1] * 8, [], _Args(batch=0))
    assert variant.calls == [("generate", 8, 4)]


def test_median_tokens_per_s_ignores_one_slow_step(peers):
    sample = peers.Sample(0.1, [60.0, 0.1, 0.1, 0.1, 0.2], batch=8)
    out = sample.to_dict()
    assert out["median_tokens_per_s"] == pytest.approx(8 / 0.1)
    assert out["tokens_per_s"] == pytest.approx(5 * 8 / 60.5)


def test_quant_head_settings_reach_the_quant_config(peers):
    """--quant-head quantizes the (tied) head with shardwise's default; --quant-head-bits sets
    its bits; both parse as shardwise's quant= and --quality-only is an option."""
    from shardwise.quant import parse_quant

    args = peers.parse_args(["--llama-cpp-src", "x", "--quant-head", "--quant-group", "32",
                             "--quality-only"])
    assert args.quality_only
    quant = peers.shardwise_kwargs("int4", args)["quant"]
    assert quant == {"weight": {"num_bits": 4, "group_size": 32}, "lm_head": True}
    args = peers.parse_args(["--llama-cpp-src", "x", "--quant-head", "--quant-head-bits", "4"])
    config = parse_quant(peers.shardwise_kwargs("int4", args)["quant"])
    assert config.lm_head and config.for_head(tied=True).bits == 4
    assert "quant" not in peers.shardwise_kwargs("bf16", args)
