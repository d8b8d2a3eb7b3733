"""``shardwise generate`` on models it cannot load: each is one line on stderr, exit code 2, naming
the file and what to do (never a traceback, never transformers' interactive trust_remote_code
prompt), raised before loading wherever the problem shows in headers or config.json; and
``--max-new-tokens`` beyond the model's positions is refused."""

from __future__ import annotations

import json
import shutil

import pytest

import shardwise.models
from shardwise.cli import main
from shardwise.cli.generate import check_new_tokens
from shardwise.errors import ConfigError
from shardwise.models import check_model_path

from models import tiny_causal_lm, tiny_tokenizer

POSITIONS = 256  # the tiny Llama's max_position_embeddings


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """A tiny Llama with the tiny tokenizer, saved with save_pretrained (copy before changing)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_causal_lm("llama").save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["max_position_embeddings"] == POSITIONS
    return path


@pytest.fixture
def model_copy(saved_llama, tmp_path):
    """A fresh copy of the saved tiny Llama this test may break."""
    return shutil.copytree(saved_llama, tmp_path / "model")


@pytest.fixture
def no_model_loading(monkeypatch):
    """Loading a model fails the test: the CLI must refuse the input from headers alone."""
    def refuse(*args, **kwargs):
        raise AssertionError("load_model was called for a model the CLI should have refused")
    monkeypatch.setattr(shardwise.models, "load_model", refuse)


def generate_error(capsys, *argv: str) -> str:
    """Run ``shardwise generate ARGV``; assert exit 2 and no traceback; the error line."""
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("shardwise: error: "), err
    return line


def edit_config(directory, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


# ----- weights missing, truncated or corrupt: refused from the files, before loading -----------

def test_directory_with_config_but_no_weights(model_copy, capsys, no_model_loading):
    (model_copy / "model.safetensors").unlink()
    line = generate_error(capsys, "--model", str(model_copy), "t5")
    assert f"model directory {str(model_copy)!r} has config.json but no weights" in line
    assert "copy the weight files next to config.json" in line


def test_truncated_safetensors(model_copy, capsys, no_model_loading):
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])  # a download cut in the middle
    line = generate_error(capsys, "--model", str(model_copy), "t5")
    assert f"{weights} is truncated" in line and "re-download or re-save it" in line


def test_safetensors_with_garbage_header(model_copy, capsys, no_model_loading):
    (model_copy / "model.safetensors").write_bytes(b"<html>404 Not Found</html>")
    line = generate_error(capsys, "--model", str(model_copy), "t5")
    assert "corrupted safetensors header" in line


def test_index_naming_a_missing_shard(model_copy, capsys, no_model_loading):
    (model_copy / "model.safetensors").rename(model_copy / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map":
                                                                             weight_map}))
    line = generate_error(capsys, "--model", str(model_copy), "t5")
    assert "names weight files that are missing: model-00002-of-00002.safetensors" in line


def test_config_json_that_is_not_json(model_copy, capsys, no_model_loading):
    (model_copy / "config.json").write_text("{truncated")
    line = generate_error(capsys, "--model", str(model_copy), "t5")
    assert f"{model_copy / 'config.json'} cannot be read as JSON" in line


@pytest.mark.parametrize("content, what", [(b"", "is empty"),
                                           (b"PK\x03\x04 a zip file", "does not start with the "
                                                                      "GGUF magic bytes "
                                                                      "(b'PK\\x03\\x04')")])
def test_file_that_is_not_gguf(tmp_path, capsys, no_model_loading, content, what):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    line = generate_error(capsys, "--model", str(path), "t5")
    assert f"{str(path)!r} {what}, so it is not a GGUF file; re-download it" in line


# ----- errors only the loader sees: one line too ---------------------------------------------

def test_truncated_gguf_is_one_line(tmp_path, capsys):
    """Valid magic, then the file ends: transformers' GGUF reader fails (struct.error)."""
    path = tmp_path / "cut.gguf"
    path.write_bytes(shardwise.models.default_model_path().read_bytes()[:100])
    line = generate_error(capsys, "--model", str(path), "--max-new-tokens", "2", "t5")
    assert f"cannot load the model at {str(path)!r}: " in line
    assert "the GGUF file is probably truncated or corrupt" in line


def test_loader_refusal_of_a_directory_is_one_line(model_copy, capsys):
    edit_config(model_copy, model_type="not_a_real_model_type")
    line = generate_error(capsys, "--model", str(model_copy), "t5")
    assert f"cannot load the model at {str(model_copy)!r}: ValueError: " in line
    assert "re-download or re-save the model" in line


# ----- a model needing its own code ------------------------------------------------------------

AUTO_MAP = {"AutoConfig": "configuration_mine.MyConfig",
            "AutoModelForCausalLM": "modeling_mine.MyForCausalLM"}


def test_model_needing_remote_code_is_refused_without_asking(model_copy, capsys,
                                                             no_model_loading):
    # transformers would ask "Do you wish to run the custom code? [y/N]" on stdin
    edit_config(model_copy, model_type="my_arch", auto_map=AUTO_MAP)
    line = generate_error(capsys, "--model", str(model_copy), "t5")
    assert f"model directory {str(model_copy)!r} needs its own Python code" in line
    assert "configuration_mine.MyConfig, modeling_mine.MyForCausalLM" in line
    assert "model_type 'my_arch'" in line and "trust_remote_code=True" in line


def test_auto_map_for_an_architecture_transformers_ships_is_fine(model_copy):
    edit_config(model_copy, auto_map=AUTO_MAP)  # model_type stays "llama": no remote code runs
    assert check_model_path(model_copy) == model_copy


# ----- --max-new-tokens beyond the model's positions ---------------------------------------

def test_more_new_tokens_than_positions_is_refused_before_loading(saved_llama, capsys,
                                                                  no_model_loading):
    line = generate_error(capsys, "--model", str(saved_llama), "--max-new-tokens",
                          str(POSITIONS), "t5")
    assert (f"--max-new-tokens {POSITIONS} does not fit: a prompt has at least 1 token and the "
            f"model takes at most {POSITIONS} positions (max_position_embeddings), so at most "
            f"{POSITIONS - 1} new tokens; pass --max-new-tokens {POSITIONS - 1} or less") in line


def test_new_tokens_plus_prompt_beyond_positions_is_refused(saved_llama, capsys, monkeypatch):
    loaded = []
    real_load = shardwise.models.load_model
    monkeypatch.setattr(shardwise.models, "load_model",
                        lambda *a, **k: loaded.append(1) or real_load(*a, **k))
    generate_calls = []
    monkeypatch.setattr("shardwise.cli.generate.timed_generate",
                        lambda *a, **k: generate_calls.append(1))
    prompt = "t5 t9 t13 t200"  # 4 tokens
    line = generate_error(capsys, "--model", str(saved_llama), "--max-new-tokens",
                          str(POSITIONS - 3), prompt)
    assert loaded and not generate_calls
    assert (f"the prompt is 4 tokens and the model takes at most {POSITIONS} positions "
            f"(max_position_embeddings), so at most {POSITIONS - 4} new tokens") in line


def test_new_token_bounds():
    check_new_tokens(252, 4, 256)  # exactly fills the positions
    check_new_tokens(10_000, 4, None)  # no declared limit (e.g. ALiBi)
    with pytest.raises(ConfigError, match="at most 252 new tokens"):
        check_new_tokens(253, 4, 256)
    with pytest.raises(ConfigError, match="no new token fits; shorten the prompt"):
        check_new_tokens(1, 256, 256)

