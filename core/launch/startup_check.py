"""The start-up check across nodes: every rank runs the same software on the same model.

Ranks on different nodes can run different installs (shardwise, torch, transformers, Python) or
load a model built from a different config; each would then compute its own shards of a
different model and the run would fail later as garbage logits or a shape error in a collective.
:func:`check_ranks_agree` catches this where the ranks first talk (just after the communicator is
created): each rank packs a small fingerprint (:func:`fingerprint`: versions, a hash of the model's
config and parameter shapes, and of the inference settings every rank must share) into a fixed
buffer, one ``all_gather`` gives every rank everyone's, and on any difference every rank raises
the same :class:`RankMismatchError` naming what differs, with each value and the ranks (and hosts)
that hold it.

    communicator = create_communicator(accelerator, cfg.comm_timeout)
    check_ranks_agree(communicator, fingerprint(model, cfg))
"""

from __future__ import annotations

import hashlib
import json
import platform
import socket
from typing import Any, Mapping

import torch

from ..errors import ConfigError

__all__ = ["COMPARED", "CONFIG_FIELDS", "FINGERPRINT_BYTES", "RankMismatchError",
           "check_ranks_agree", "fingerprint", "mismatches"]

#: Bytes of one rank's packed fingerprint (UTF-8 JSON, zero-padded); values are cut to
#: :data:`_VALUE_CHARS`, so the whole stays far below this.
FINGERPRINT_BYTES = 1024
_VALUE_CHARS = 80

#: fingerprint key -> what the error calls it (the keys compared, in the order reported)
COMPARED = {
    "shardwise": "shardwise version",
    "torch": "torch version",
    "transformers": "transformers version",
    "python": "Python version",
    "model": "model class",
    "model_config": "model config (hash)",
    "model_params": "model parameter names and shapes (hash)",
    "settings": "inference settings (hash of {fields})",
}

#: InferenceConfig fields every rank must share (paths such as checkpoint, base_dir or the
#: offload directory may differ per node and are not compared)
CONFIG_FIELDS = ("tp_size", "pipeline_parallel", "dtype", "replace_with_kernel_inject",
                 "injection_policy", "enable_graph", "max_tokens", "quant", "seed", "moe",
                 "dp_size")

#: config keys that name where or when a model was saved, not what it is
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "_commit_hash",
                         "_attn_implementation_autoset")


class RankMismatchError(ConfigError):
    """Ranks run different software versions or models (found at start-up, before any shard is
    made); the message names each difference and which ranks hold which value."""


def _canonical(value: Any) -> Any:
    """``value`` as JSON-able data that is the same on every rank for equal settings: classes and
    functions by qualified name (an ``injection_policy`` is keyed by layer classes), mappings as
    key-sorted pairs, other objects by ``repr`` (dataclass settings, dtypes)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, type) or callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', value)}"
    if isinstance(value, Mapping):
        return sorted(([_canonical(k), _canonical(v)] for k, v in value.items()), key=str)
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return repr(value)


def _digest(payload: Any) -> str:
    text = json.dumps(_canonical(payload))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _module_version(name: str) -> str | None:
    """``name.__version__`` if the module is importable (None when it is not installed)."""
    try:
        module = __import__(name)
    except ImportError:
        return None
    return str(getattr(module, "__version__", "unknown"))


def _config_digest(model: torch.nn.Module) -> str | None:
    """Hash of the model's HF config without the keys that say where or when it was saved."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    values = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return _digest(values)


def _params_digest(model: torch.nn.Module) -> str:
    """Hash of every parameter's and buffer's name, shape and dtype (meta tensors included)."""
    return _digest([(name, list(t.shape), str(t.dtype)) for name, t in
                    [*model.named_parameters(), *model.named_buffers()]])


def fingerprint(model: torch.nn.Module | None = None, cfg: Any = None) -> dict[str, str | None]:
    """This rank's fingerprint: the versions of shardwise, torch, transformers and Python, and
    (when given) hashes of ``model``'s config and parameter shapes and of the fields of the
    inference config ``cfg`` listed in :data:`CONFIG_FIELDS`; ``host`` says where it runs (not
    compared). Values are strings or None (not applicable); every rank must build it the same
    way."""
    from .. import __version__

    out: dict[str, str | None] = {
        "host": socket.gethostname(), "shardwise": __version__, "torch": torch.__version__,
        "transformers": _module_version("transformers"), "python": platform.python_version(),
        "model": None, "model_config": None, "model_params": None, "settings": None}
    if model is not None:
        out.update(model=type(model).__name__, model_config=_config_digest(model),
                   model_params=_params_digest(model))
    if cfg is not None:
        out["settings"] = _digest({f: getattr(cfg, f, None) for f in CONFIG_FIELDS})
    return out


def _pack(fp: Mapping[str, str | None]) -> torch.Tensor:
    """``fp`` as a ``[1, FINGERPRINT_BYTES]`` uint8 tensor (UTF-8 JSON, zero-padded)."""
    cut = {k: (v[:_VALUE_CHARS] if isinstance(v, str) else v) for k, v in fp.items()}
    data = json.dumps(cut, sort_keys=True).encode()
    if len(data) > FINGERPRINT_BYTES:
        raise ConfigError(f"start-up fingerprint is {len(data)} bytes, more than the "
                          f"{FINGERPRINT_BYTES} the check exchanges: fewer or shorter keys")
    buf = torch.zeros(1, FINGERPRINT_BYTES, dtype=torch.uint8)
    buf[0, :len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return buf


def _unpack(row: torch.Tensor) -> dict[str, str | None]:
    data = bytes(row.tolist()).rstrip(b"\0")
    return json.loads(data.decode())


def _ranks_text(ranks: list[int], hosts: list[str]) -> str:
    where = sorted({hosts[r] for r in ranks})
    label = "rank" if len(ranks) == 1 else "ranks"
    return f"{label} {', '.join(map(str, ranks))} (host {', '.join(where)})"


def mismatches(fingerprints: list[Mapping[str, str | None]]) -> list[str]:
    """One line per compared key on which the ranks' fingerprints (index = rank) differ:
    ``"torch version: '2.13.0' on rank 0 (host a); '2.12.0' on rank 1 (host b)"``."""
    hosts = [str(fp.get("host")) for fp in fingerprints]
    lines = []
    for key, label in COMPARED.items():
        holders: dict[Any, list[int]] = {}
        for rank, fp in enumerate(fingerprints):
            holders.setdefault(fp.get(key), []).append(rank)
        if len(holders) > 1:
            label = label.format(fields=", ".join(CONFIG_FIELDS))
            values = "; ".join(f"{value!r} on {_ranks_text(ranks, hosts)}"
                               for value, ranks in holders.items())
            lines.append(f"{label}: {values}")
    return lines


def check_ranks_agree(communicator, fp: Mapping[str, str | None]) -> None:
    """Compare this rank's fingerprint ``fp`` (:func:`fingerprint`) with every other rank's in
    one ``all_gather`` of :data:`FINGERPRINT_BYTES` bytes per rank; nothing at world size 1.

    Every rank must call it at the same point (it is a collective). On any difference, every
    rank raises the same :class:`RankMismatchError` listing each difference.
    """
    world = getattr(communicator, "world_size", 1)
    if world <= 1:
        return
    rows = communicator.all_gather(_pack(fp), dim=0)  # [world, FINGERPRINT_BYTES]
    found = mismatches([_unpack(row) for row in rows])
    if found:
        raise RankMismatchError(
            f"the {world} ranks do not run the same software or model (checked at start-up, "
            f"before any weight work):\n  " + "\n  ".join(found) + "\nInstall the same "
            f"shardwise, torch and transformers on every node (e.g. one container image), and "
            f"give every rank the same model and inference settings.")
