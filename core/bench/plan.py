"""What a benchmark run measures: models × cells (batch, prompt length, new tokens) × variants,
validated cheaply before any model is loaded."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Any

from ..accelerator import Accelerator
from ..config import parse_dtype
from ..errors import ConfigError
from ..models import DEFAULT_MODEL_NAME, check_model_path, default_model_path
from .presets import get_preset

#: ``--quant`` choice → the ``quant=`` argument of ``init_inference``.
QUANT_CONFIGS = {"int8": {"weight": {"num_bits": 8}}, "int4": {"weight": {"num_bits": 4}}}
BASELINE = "hf"


@dataclass(frozen=True)
class ModelSpec:
    """A model to benchmark: ``kind`` is ``"default"`` (the embedded model), ``"path"`` (a HF
    directory or GGUF file) or ``"preset"``; ``name`` is what the table shows."""

    kind: str
    name: str
    path: str | None = None


@dataclass(frozen=True)
class Cell:
    """One point of the shape matrix."""

    batch: int
    prompt_len: int
    new_tokens: int


@dataclass
class Plan:
    """A validated benchmark run (see :func:`make_plan`). ``dtype`` is a short name or None for
    each model's own dtype; ``engine_options`` are the shardwise variant's extra
    ``init_inference`` keywords."""

    models: list[ModelSpec]
    cells: list[Cell]
    device: str
    dtype: str | None = None
    tp: int = 1
    nnodes: int = 1
    engine_options: dict[str, Any] = field(default_factory=dict)
    warmup: int = 1
    repeats: int = 3
    seed: int = 0
    #: the HF baseline's dtype when it differs from ``dtype`` (``--baseline-dtype``); the model
    #: is then loaded in it and the shardwise variant casts to ``dtype``.
    baseline_dtype: str | None = None

    @property
    def variant(self) -> str:
        """The shardwise variant's name, its options in brackets (``shardwise[tp2,int8]``)."""
        tags = [f"tp{self.tp}"] if self.tp > 1 else []
        tags += [{"replace_with_kernel_inject": "inject", "enable_graph": "graphs"}.get(k, k)
                 for k in self.engine_options if k != "quant"]
        if "quant" in self.engine_options:
            tags.append(f"int{self.engine_options['quant']['weight']['num_bits']}")
        return f"shardwise[{','.join(tags)}]" if tags else "shardwise"

    def engine_kwargs(self) -> dict[str, Any]:
        """Keywords of ``init_inference`` for the shardwise variant."""
        kwargs = {"device": self.device, "dtype": self.dtype, **self.engine_options}
        if self.tp > 1:
            kwargs["tensor_parallel"] = {"tp_size": self.tp}
        return kwargs

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for the JSON report and the per-rank workers)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """Inverse of :meth:`to_dict`."""
        data = dict(data)
        data["models"] = [ModelSpec(**m) for m in data["models"]]
        data["cells"] = [Cell(**c) for c in data["cells"]]
        return cls(**data)


def resolve_models(paths: list[str] | None, presets: list[str] | None) -> list[ModelSpec]:
    """The models to run: each ``--model`` path (checked for config.json / .gguf) and each
    ``--preset`` (checked against the list); neither → the embedded default model."""
    checked = [str(check_model_path(p)) for p in paths or []]
    specs = [ModelSpec("path", p, p) for p in checked]
    specs += [ModelSpec("preset", get_preset(name).name) for name in presets or []]
    if not specs:
        specs.append(ModelSpec("default", DEFAULT_MODEL_NAME, str(default_model_path())))
    if any(s.path and s.path.endswith(".gguf") for s in specs) and not find_spec("gguf"):
        raise ConfigError("loading a GGUF file (the default model is one) needs the gguf "
                          "package (a dependency of shardwise): pip install gguf")
    return list(dict.fromkeys(specs))  # each model once, in the order given


def check_tp(accelerator: Accelerator, tp: int, nnodes: int = 1) -> int:
    """Validate ``--tp`` against the ranks the nodes can host; return ranks per node."""
    if tp < 1 or nnodes < 1:
        raise ConfigError(f"--tp and --nnodes must be positive, got --tp {tp} --nnodes {nnodes}")
    per_node = accelerator.max_ranks_per_node()
    if tp > per_node * nnodes:
        raise ConfigError(
            f"--tp {tp} needs {tp} ranks but {nnodes} node(s) of {accelerator.name!r} host at "
            f"most {per_node * nnodes} ({per_node} per node); lower --tp or add nodes (--nnodes)")
    if tp % nnodes:
        raise ConfigError(f"--tp {tp} does not split evenly over --nnodes {nnodes}")
    return tp // nnodes


def resolve_dtype_name(accelerator: Accelerator, dtype: str | None) -> str | None:
    """``dtype`` as a short torch name after the accelerator's veto (its own error);
    ``"auto"`` → its preferred dtype; None stays None (each model's own dtype)."""
    if dtype is None:
        return None
    parsed = accelerator.preferred_dtype if dtype == "auto" else parse_dtype(dtype)
    return str(accelerator.check_dtype(parsed)).removeprefix("torch.")


def engine_options(inject: bool = False, graphs: bool = False,
                   quant: str | None = None) -> dict[str, Any]:
    """The shardwise variant's ``init_inference`` keywords for ``--inject/--graphs/--quant``."""
    options: dict[str, Any] = {}
    if inject:
        options["replace_with_kernel_inject"] = True
    if graphs:
        options["enable_graph"] = True
    if quant is not None:
        if quant not in QUANT_CONFIGS:
            raise ConfigError(f"--quant {quant!r} is not one of {', '.join(QUANT_CONFIGS)}")
        options["quant"] = QUANT_CONFIGS[quant]
    return options


def make_cells(batches: list[int], prompt_lens: list[int], new_tokens: list[int]) -> list[Cell]:
    """Every combination of the three lists (all values must be positive)."""
    for name, values in (("--batch", batches), ("--prompt-len", prompt_lens),
                         ("--new-tokens", new_tokens)):
        if any(v < 1 for v in values):
            raise ConfigError(f"{name} values must be positive integers, got {values}")
    return [Cell(b, p, n) for b in batches for p in prompt_lens for n in new_tokens]
