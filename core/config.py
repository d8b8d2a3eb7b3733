"""The typed inference config: every field is used or rejected, never silently ignored.

``InferenceConfig.build(config, **kwargs)`` merges a config (an ``InferenceConfig``, a dict, or a
path to a JSON file) with keyword arguments. DeepSpeed-Inference's names are accepted
(:data:`ALIASES`) so switching is a change of import. The merge rule: a field given in both places
must have the same value there, else :class:`ConfigError` names the field and both values; nothing
silently takes precedence.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch

from .communicator import resolve_timeout
from .errors import ConfigError, NotSupportedYetError

if TYPE_CHECKING:
    from .offload.config import OffloadConfig
    from .pipeline.config import PipelineSettings

_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}
#: DeepSpeed keyword → shardwise field.
ALIASES = {"mp_size": "tp_size", "enable_cuda_graph": "enable_graph",
           "max_out_tokens": "max_tokens", "offload_param": "offload",
           "data_parallel_size": "dp_size"}
#: Keys accepted inside ``tensor_parallel={...}`` (DeepSpeed's DeepSpeedTPConfig names).
_TP_KEYS = {"tp_size", "enabled"}
#: The seeds ``torch.manual_seed`` accepts: any int64 or uint64 value.
SEED_RANGE = (-0x8000_0000_0000_0000, 0xFFFF_FFFF_FFFF_FFFF)


@dataclass
class InferenceConfig:
    """Options of :func:`shardwise.init_inference`.

    Attributes:
        device: accelerator plugin name (``"cpu"``, ``"cuda"``, ``"hpu"``, a third party's);
            ``None`` uses ``$SHARDWISE_ACCELERATOR`` or detection.
        dtype: compute dtype (torch dtype or ``"fp16"``/``"bf16"``/``"fp32"``/``"auto"``).
            ``None`` keeps the model's dtype; ``"auto"`` takes the accelerator's preferred one.
        weight_dtype: storage dtype of the linear weights under a wider compute dtype,
            ``torch.bfloat16``/``torch.float16`` (or ``"bf16"``/``"fp16"``) with an fp32
            model: each weight is rounded to it once, and activations, norms, attention and the
            residual stream stay fp32 (y = x @ float(W) + b, nothing else rounded: what
            llama.cpp's F16/BF16 files run; ``dtype=torch.bfloat16`` instead rounds every
            activation too). Half the weight bytes of fp32 at much closer to fp32's outputs
            than a bf16 model. Kept by the graph strategy's weight layout, so it needs
            ``enable_graph=True`` and an accelerator whose strategy lists the dtype in its
            ``weight_dtypes`` (the CPU's: bf16 and fp16); not with ``quant`` (already a
            weight format) or ``offload``. The tied input embedding (one table with the
            head) is stored so too; untied embeddings and MoE experts' stacked tensors stay
            fp32 (one warning at init names them).
        tp_size: tensor-parallel degree (``tensor_parallel={"tp_size": N}`` or ``mp_size=N``).
            The world (torchrun's WORLD_SIZE) must equal it; each rank keeps ~1/N of the
            weights (see ``shardwise.sharding``).
        replace_with_kernel_inject: replace supported layers with shardwise's fused layers.
        injection_policy: the tensor-parallel plan, overriding the model's and the policy's:
            DeepSpeed's ``{BlockClass: ("self_attn.o_proj", "mlp.down_proj")}`` (the named
            linears are row-parallel, the block's other linears column-parallel), or
            ``{"module.pattern": role}``. Every name must exist in the model.
        seed: seeds torch's RNGs on every rank at ``init_inference`` so sampling in
            ``generate()`` draws the same tokens on all ranks. ``None`` (default) means 0 when
            ``tp_size > 1`` and leaves the RNG alone otherwise. An int in
            [-2**63, 2**64 - 1] (what ``torch.manual_seed`` takes).
        enable_graph: capture the decode step with the accelerator's graph strategy
            (alias ``enable_cuda_graph``).
        checkpoint: checkpoint directory or description file (JSON path or dict).
        base_dir: directory the checkpoint description's file names are relative to.
        save_mp_checkpoint_path: where to write the sharded checkpoint after loading.
        max_tokens: KV-cache capacity in tokens, prompt included (alias ``max_out_tokens``).
        quant: weight-quantization settings, ``{"weight": {"num_bits": 8, ...}}`` (all keys and
            DeepSpeed MoQ's mapping: :mod:`shardwise.quant.config`). ``dtype=torch.int8`` means
            8-bit weights with the accelerator's preferred compute dtype (bf16 on CPU).
        comm_timeout: seconds before a collective gives up, a finite number > 0 (default
            ``$SHARDWISE_COMM_TIMEOUT`` or 300; a malformed variable is a ConfigError here).
        moe: Mixture-of-Experts settings, DeepSpeed's ``moe`` dict (``{"ep_size": N}``,
            ``enabled``, ``moe_experts``/``num_experts``, ``type``/``moe_type``; shardwise's
            ``dispatch``: ``auto``, ``all_reduce`` or ``all_to_all``) or ``True``; normalised
            to a :class:`MoESettings` (every key used or refused by name: see
            :func:`parse_moe`). Checked against the model in the plan.
        offload: ZeRO-Inference: keep the weights in host memory or on disk and stream each
            layer in just before it runs (alias ``offload_param``, DeepSpeed's names):
            ``{"device": "cpu" | "nvme", "nvme_path": DIR, "buffer_count": K, "pin_memory":
            bool}``; normalised to an :class:`~shardwise.offload.config.OffloadConfig`
            (``{"device": "none"}`` → None; every key used or refused by name: see
            :func:`~shardwise.offload.config.parse_offload`). With ``enable_graph`` the decode
            step is captured one layer at a time (:mod:`shardwise.offload.graphs`).
            Checked against the machine and the model before anything changes.
        pipeline_parallel: pipeline stages, ``{"pp_size": P}`` (P × tp ranks: the decoder
            layers cut into P contiguous stages balanced by weight bytes read per step (the
            head's counted, the embedding's not), each stage split by
            ``tensor_parallel`` among its ranks) with an optional ``"split": [n_0, ...,
            n_{P-1}]`` (layers per stage, first stage first; must cover every layer once) and
            ``"micro_batches": M`` (micro-batches in flight, forwards and ``generate``);
            normalised to a :class:`~shardwise.pipeline.PipelineSettings` (None when off: see
            :func:`~shardwise.pipeline.parse_pipeline`). Composes with ``checkpoint`` (each
            rank reads its stage's tensors), ``quant``, injection and ``offload`` (what is
            not supported yet is refused by name: :func:`~shardwise.pipeline.config.
            check_with_other_fields`).
        dp_size: data-parallel replicas (alias ``data_parallel_size``): world = pp × tp × dp,
            ranks laid out tp fastest, then dp, then pp; each replica (a tensor-parallel group,
            or a pipeline of pp × tp ranks) runs on the inputs of its own first rank, and no
            collective crosses replicas (unless they form one expert-parallel group, which
            then shares rank 0's inputs). ``None``: the world's remainder after pp × tp.
        fuse_projections: with injection, run separate q, k, v as one projection and separate
            gate, up as one, over one copy of the weights (the HF parameters become views of
            the fused tensors: :mod:`shardwise.inject.fuse`); ``None``: the
            ``SHARDWISE_FUSE_PROJECTIONS`` environment variable, default on.
    """

    device: str | None = None
    dtype: torch.dtype | str | None = None
    weight_dtype: torch.dtype | str | None = None
    tp_size: int = 1
    replace_with_kernel_inject: bool = False
    injection_policy: dict | None = None
    enable_graph: bool = False
    checkpoint: str | dict | None = None
    base_dir: str | None = None
    save_mp_checkpoint_path: str | None = None
    max_tokens: int = 1024
    quant: dict | None = None
    comm_timeout: float | None = None
    seed: int | None = None
    moe: "MoESettings | dict | bool | None" = None
    offload: "OffloadConfig | dict | None" = None
    pipeline_parallel: "PipelineSettings | dict | int | None" = None
    dp_size: int | None = None
    fuse_projections: bool | None = None

    # ----- construction -------------------------------------------------------------------------

    @classmethod
    def build(cls, config: "InferenceConfig | Mapping | str | os.PathLike | None" = None,
              **kwargs: Any) -> "InferenceConfig":
        """Merge ``config`` and ``kwargs`` (see module docstring), validate, and return."""
        base = _normalise(_as_mapping(config), "config")
        extra = _normalise(kwargs, "keyword")
        for key in base.keys() & extra.keys():
            if not _same(base[key], extra[key]):
                raise ConfigError(
                    f"{key!r} is {base[key]!r} in the config but {extra[key]!r} as a keyword "
                    f"argument; give it once, or the same value in both places")
        merged = {**base, **extra}
        cfg = cls(**merged)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Check types and ranges; reject fields whose feature has not landed."""
        self.dtype = parse_dtype(self.dtype)
        _check_type("device", self.device, (str, type(None)))
        for name in ("replace_with_kernel_inject", "enable_graph"):
            _check_type(name, getattr(self, name), (bool,))
        _check_type("fuse_projections", self.fuse_projections, (bool, type(None)))
        for name in ("tp_size", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.dp_size is not None and (isinstance(self.dp_size, bool)
                                         or not isinstance(self.dp_size, int) or self.dp_size < 1):
            raise ConfigError(f"dp_size must be a positive integer (data-parallel replicas: "
                              f"world = pp_size × tp_size × dp_size), or None for the world's "
                              f"remainder; got {self.dp_size!r}")
        _check_seed(self.seed)
        _check_type("injection_policy", self.injection_policy, (dict, type(None)))
        _check_checkpoint_fields(self)
        resolve_timeout(self.comm_timeout)  # the field, or the variable it falls back on
        _reject_unlanded(self)
        _check_offload(self)
        _check_injection(self)
        _check_quant(self)
        _check_weight_dtype(self)
        self.moe = parse_moe(self.moe)
        _check_pipeline(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (dtype as its short name), e.g. for a benchmark's provenance."""
        out = dataclasses.asdict(self)
        for name in ("dtype", "weight_dtype"):
            if isinstance(getattr(self, name), torch.dtype):
                out[name] = str(getattr(self, name)).removeprefix("torch.")
        return out


def field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(InferenceConfig)]


def parse_dtype(value: Any) -> torch.dtype | str | None:
    """A torch dtype from a dtype, a name (``"bf16"``, ``"torch.float16"``), ``"auto"`` or None."""
    if value is None or isinstance(value, torch.dtype) or value == "auto":
        return value
    if isinstance(value, str):
        key = value.lower().removeprefix("torch.")
        if key in _DTYPES:
            return _DTYPES[key]
    raise ConfigError(f"dtype {value!r} is not understood; use a torch dtype or one of "
                      f"{', '.join(sorted(_DTYPES))}, auto")


# ----- helpers ------------------------------------------------------------------------------------

def _as_mapping(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, InferenceConfig):
        return {f: v for f, v in config.__dict__.items()
                if v != getattr(InferenceConfig, f, dataclasses.MISSING)}
    if isinstance(config, (str, os.PathLike)):
        return _read_config_file(config)
    if isinstance(config, Mapping):
        return dict(config)
    raise ConfigError(f"config must be an InferenceConfig, a dict or a JSON file path, "
                      f"got {type(config).__name__}")


def _read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in ``path``; ConfigError when it is missing, unreadable, not JSON, or JSON
    that is not an object of fields."""
    shown = repr(os.fspath(path))
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {shown} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {shown} is a directory; give the path of a JSON "
                          f"file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {shown} is not valid JSON: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {shown} cannot be read: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {shown} holds a JSON {_json_kind(data)}; it must hold "
                          f"one object of config fields, e.g. {{\"dtype\": \"bf16\", "
                          f"\"tensor_parallel\": {{\"tp_size\": 2}}}}")
    return data


def _json_kind(value: Any) -> str:
    """The JSON name of a decoded value's type (``list`` → ``array``)."""
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


def _normalise(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Map DeepSpeed names onto fields and flatten ``tensor_parallel``; unknown keys fail."""
    out: dict[str, Any] = {}
    known = field_names()
    for key, value in values.items():
        if not isinstance(key, str):
            raise ConfigError(f"{where} field names must be strings, got {key!r} "
                              f"(valid fields: {', '.join(known)})")
        if key == "tensor_parallel":
            items = _tp_items(value)
        elif ALIASES.get(key, key) in _NORMALISERS:  # normalised first, so equal settings
            name = ALIASES.get(key, key)               # spelled differently agree
            items = {name: _NORMALISERS[name](value)}
        elif key in ALIASES:
            items = {ALIASES[key]: value}
        elif key in known:
            items = {key: value}
        else:
            close = difflib.get_close_matches(key, [*known, *ALIASES, "tensor_parallel"], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown {where} field {key!r}{hint} "
                              f"(valid fields: {', '.join(known)})")
        for name, v in items.items():
            if name in out and not _same(out[name], v):
                raise ConfigError(f"{name!r} is given twice with different values "
                                  f"({out[name]!r} and {v!r}) in the {where} arguments")
            out[name] = v
    return out


def _parse_pipeline(value: Any) -> "PipelineSettings | None":
    from .pipeline.config import parse_pipeline

    return parse_pipeline(value)


def _check_pipeline(cfg: InferenceConfig) -> None:
    """Normalise ``pipeline_parallel`` and refuse the settings it does not compose with yet
    (:func:`shardwise.pipeline.config.check_with_other_fields`)."""
    from .pipeline.config import check_with_other_fields

    cfg.pipeline_parallel = _parse_pipeline(cfg.pipeline_parallel)
    check_with_other_fields(cfg)


def _parse_offload(value: Any) -> "OffloadConfig | None":
    from .offload.config import parse_offload  # here: shardwise.offload is loaded on first use

    return parse_offload(value)


def _tp_items(value: Any) -> dict[str, Any]:
    if isinstance(value, int) and not isinstance(value, bool):
        return {"tp_size": value}
    if not isinstance(value, Mapping):
        raise ConfigError(f"tensor_parallel must be a dict like {{'tp_size': 2}}, got {value!r}")
    unknown = set(value) - _TP_KEYS
    if unknown:
        raise ConfigError(f"unknown tensor_parallel field(s) {sorted(unknown)}; "
                          f"valid: {sorted(_TP_KEYS)}")
    if value.get("enabled", True) is False:
        return {"tp_size": 1}
    return {"tp_size": value["tp_size"]} if "tp_size" in value else {}


def _same(a: Any, b: Any) -> bool:
    try:
        return parse_dtype(a) == parse_dtype(b)
    except ConfigError:
        return a == b


def _check_type(name: str, value: Any, types: tuple[type, ...]) -> None:
    if not isinstance(value, types):
        want = " or ".join("None" if t is type(None) else t.__name__ for t in types)
        raise ConfigError(f"{name} must be {want}, got {type(value).__name__} {value!r}")


def _check_seed(seed: Any) -> None:
    """None, or an int ``torch.manual_seed`` accepts (not a bool)."""
    if seed is None:
        return
    low, high = SEED_RANGE
    if isinstance(seed, bool) or not isinstance(seed, int) or not low <= seed <= high:
        raise ConfigError(f"seed must be None or an integer from -2**63 to 2**64 - 1 (what "
                          f"torch.manual_seed accepts), got {seed!r}")


#: Fields whose feature has not landed yet: field → what it enables. A non-default value fails.
NOT_YET_SUPPORTED: dict[str, str] = {
}


def _check_checkpoint_fields(cfg: InferenceConfig) -> None:
    _check_type("checkpoint", cfg.checkpoint, (str, os.PathLike, dict, type(None)))
    for name in ("base_dir", "save_mp_checkpoint_path"):
        _check_type(name, getattr(cfg, name), (str, os.PathLike, type(None)))
    if cfg.base_dir is not None and cfg.checkpoint is None:
        raise ConfigError("base_dir is where a checkpoint description's files are; it needs "
                          "checkpoint=... (a description file or dict) as well")


def _reject_unlanded(cfg: InferenceConfig) -> None:
    defaults = InferenceConfig()
    for name, feature in NOT_YET_SUPPORTED.items():
        if getattr(cfg, name) != getattr(defaults, name):
            raise NotSupportedYetError(
                f"{name}={getattr(cfg, name)!r} asks for {feature}, which this version of "
                f"shardwise does not support yet; remove it (it would not be silently ignored)")


def _check_quant(cfg: InferenceConfig) -> None:
    """Validate ``quant`` (every key used or rejected by name, see :mod:`shardwise.quant.config`)
    and map DeepSpeed's ``dtype=torch.int8`` onto it: 8-bit weights, compute dtype ``"auto"`` (the
    accelerator's preferred one: bf16 on a CPU with native bf16, whose packed int8/int4 kernels
    are bf16-only; fp16/bf16 on GPUs). ``quant`` is normalised to the dict the engine reads."""
    from .quant.config import parse_quant

    int8 = cfg.dtype == torch.int8
    parsed = parse_quant(cfg.quant, default_bits=8 if int8 else None)
    if int8:
        cfg.dtype = "auto"
    cfg.quant = parsed.to_dict() if parsed is not None else None


#: The storage dtypes ``weight_dtype`` takes (under an fp32 compute dtype).
WEIGHT_DTYPES = (torch.bfloat16, torch.float16)


def _check_weight_dtype(cfg: InferenceConfig) -> None:
    """Validate ``weight_dtype`` against the other fields (the compute dtype and the
    accelerator's graph strategy are checked again at init, once they are known)."""
    if cfg.weight_dtype is None:
        return
    wd = parse_dtype(cfg.weight_dtype)
    if wd not in WEIGHT_DTYPES:
        raise ConfigError(f"weight_dtype {cfg.weight_dtype!r} is not a storage dtype shardwise "
                          f"keeps weights in; use torch.bfloat16 or torch.float16 (under "
                          f"dtype=torch.float32), or leave it None")
    cfg.weight_dtype = wd
    name = str(wd).removeprefix("torch.")
    if isinstance(cfg.dtype, torch.dtype):
        check_weight_dtype_compute(wd, cfg.dtype)
    if cfg.quant is not None:
        raise ConfigError(f"weight_dtype={name} with quant=: quantization already sets the "
                          f"weights' format; give one of them")
    if cfg.offload is not None:
        raise ConfigError(f"weight_dtype={name} with offload= is not supported yet (the "
                          f"offloaded blobs hold the weights in the compute dtype); drop one")
    if not cfg.enable_graph:
        raise ConfigError(f"weight_dtype={name} is kept by the decode graphs' weight layout: "
                          f"it needs enable_graph=True (and replace_with_kernel_inject=True)")


def check_weight_dtype_compute(weight_dtype: torch.dtype, dtype: torch.dtype) -> None:
    """Refuse ``weight_dtype`` under a compute dtype other than fp32: given as ``dtype``, or
    the model's own once init resolves it."""
    if dtype != torch.float32:
        name = str(weight_dtype).removeprefix("torch.")
        raise ConfigError(f"weight_dtype={name} keeps {name} weights under fp32 activations, "
                          f"and the compute dtype is {dtype}; pass dtype=torch.float32, or "
                          f"drop weight_dtype for {dtype} everywhere")


def _check_injection(cfg: InferenceConfig) -> None:
    """enable_graph and max_tokens act on the injected model: without injection they would do
    nothing, so they are refused rather than ignored."""
    if cfg.replace_with_kernel_inject:
        return
    if cfg.enable_graph:
        raise ConfigError("enable_graph=True (enable_cuda_graph) captures the injected decode "
                          "step; it needs replace_with_kernel_inject=True")
    if cfg.max_tokens != InferenceConfig.max_tokens:
        raise ConfigError(f"max_tokens={cfg.max_tokens!r} (max_out_tokens) sizes the static KV "
                          f"cache of injected models; it needs replace_with_kernel_inject=True")
    if cfg.fuse_projections is not None:
        raise ConfigError(f"fuse_projections={cfg.fuse_projections!r} fuses the injected layers' "
                          f"q|k|v and gate|up projections; it needs "
                          f"replace_with_kernel_inject=True")


def _check_offload(cfg: InferenceConfig) -> None:
    """Normalise ``offload`` (see :func:`~shardwise.offload.config.parse_offload`). Graphs with
    it depend on the accelerator's graph strategy (captured one layer at a time, between the
    ring's waits): :func:`~shardwise.offload.config.check_offload` decides, at init."""
    cfg.offload = _parse_offload(cfg.offload)


# ----- moe ----------------------------------------------------------------------------------------

class MoEConfigError(ConfigError):
    """A ``moe=`` setting that is malformed or does not fit the model (the message says the fix)."""


#: The MoE layer types DeepSpeed names: ``standard`` (routed experts only) and ``residual``
#: (routed experts plus an always-on dense expert: a model with shared experts).
MOE_TYPES = ("standard", "residual")
#: DeepSpeed's process-group fields: shardwise makes its groups from the plan, so these are refused.
_MOE_GROUP_KEYS = ("ep_mp_group", "ep_group", "expert_group")
#: DeepSpeed ``moe`` key → :class:`MoESettings` field (``num_experts`` and ``moe_type`` are the
#: aliases DeepSpeed's ``DeepSpeedMoEConfig`` accepts for ``moe_experts`` and ``type``).
_MOE_KEYS = {"enabled": "enabled", "ep_size": "ep_size", "moe_experts": "num_experts",
             "num_experts": "num_experts", "type": "type", "moe_type": "type",
             "dispatch": "dispatch"}
#: how the routed experts' outputs of an expert-parallel group are combined (``dispatch``):
#: ``all_reduce`` (every rank holds the same tokens: each computes its experts for all of them
#: and one all-reduce sums them), ``all_to_all`` (tokens travel to the ranks of their experts and
#: back: :mod:`shardwise.moe.dispatch`), ``auto`` (the measured choice for how the ranks hold
#: their tokens: see :func:`shardwise.moe.dispatch.resolve_dispatch`)
MOE_DISPATCHES = ("auto", "all_reduce", "all_to_all")


@dataclass(frozen=True)
class MoESettings:
    """The ``moe=`` config field, validated (the model-dependent checks are the plan's).

    Attributes:
        ep_size: expert-parallel degree (experts split over this many ranks, ±1 each).
        num_experts: the expert counts the user expects (DeepSpeed's ``moe_experts`` list, one
            entry per MoE layer group), each checked against the model's; None: not checked.
        type: ``"standard"`` or ``"residual"`` (checked against whether the model has shared
            experts); None: not checked.
        dispatch: how an expert-parallel group combines its routed outputs (one of
            :data:`MOE_DISPATCHES`; shardwise's own key, DeepSpeed has none).
    """

    ep_size: int = 1
    num_experts: tuple[int, ...] | None = None
    type: str | None = None
    dispatch: str = "auto"


def parse_moe(value: Any) -> MoESettings | None:
    """``moe=`` as :class:`MoESettings`: ``None``/``False``/``{"enabled": False}`` → None (off),
    ``True`` → the defaults, a dict of DeepSpeed's ``DeepSpeedMoEConfig`` names → its values.

    Raises:
        MoEConfigError: an unknown key, a group object (shardwise builds its groups from the
            plan), a malformed value, or ``enabled=False`` together with other settings.
    """
    if value is None or value is False:
        return None
    if value is True:
        return MoESettings()
    if isinstance(value, MoESettings):
        value = dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        raise MoEConfigError(f"moe must be True, None or a dict like {{'ep_size': 2}} (DeepSpeed's "
                             f"moe config), got {type(value).__name__} {value!r}")
    _refuse_moe_groups(value)
    unknown = [k for k in value if k not in (*_MOE_KEYS, *_MOE_FIELDS, *_MOE_GROUP_KEYS)]
    if unknown:
        raise MoEConfigError(f"unknown moe field(s) {unknown}; valid: "
                             f"{sorted({*_MOE_KEYS, *_MOE_GROUP_KEYS})}")
    fields: dict[str, Any] = {}
    for key, v in value.items():
        if key in _MOE_GROUP_KEYS:
            continue  # None (DeepSpeed's default): nothing to use; a group was refused above
        name = _MOE_KEYS.get(key, key)
        if name in fields and fields[name] != v:
            raise MoEConfigError(f"moe field {name!r} is given twice with different values "
                                 f"({fields[name]!r} and {v!r}); give it once")
        fields[name] = v
    enabled = fields.pop("enabled", True)
    _check_type("moe enabled", enabled, (bool,))
    if not enabled:
        if any(fields.get(f) not in (None, getattr(MoESettings, f)) for f in _MOE_FIELDS):
            raise MoEConfigError(f"moe={dict(value)!r} says enabled=False but sets other fields; "
                                 f"drop enabled=False, or the other fields")
        return None
    settings = MoESettings(ep_size=_moe_ep_size(fields.get("ep_size", 1)),
                           num_experts=_moe_expert_counts(fields.get("num_experts")),
                           type=_moe_type(fields.get("type")),
                           dispatch=_moe_dispatch(fields.get("dispatch", "auto")))
    if settings.dispatch != "auto" and settings.ep_size == 1:
        raise MoEConfigError(f"moe dispatch={settings.dispatch!r} says how the ranks of an "
                             f"expert-parallel group combine their experts' outputs, but "
                             f"ep_size=1 has no such group; give ep_size > 1 or drop dispatch")
    return settings


_MOE_FIELDS = tuple(f.name for f in dataclasses.fields(MoESettings))


def _refuse_moe_groups(value: Mapping) -> None:
    for key in _MOE_GROUP_KEYS:
        if value.get(key) is not None:
            raise MoEConfigError(
                f"moe {key}= takes a process group; shardwise makes its expert-parallel groups "
                f"itself from the plan (world = pp × tp × dp, ep carved out of tp × dp): remove "
                f"{key} and give ep_size")


def _moe_ep_size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MoEConfigError(f"moe ep_size must be a positive integer, got {value!r}")
    return value


def _moe_expert_counts(value: Any) -> tuple[int, ...] | None:
    """DeepSpeed's ``moe_experts``: an int or a list of ints (one per MoE layer group)."""
    if value is None:
        return None
    counts = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(counts, (list, tuple)) or not counts
            or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts)):
        raise MoEConfigError(f"moe moe_experts (num_experts) must be a positive integer or a "
                             f"list of them (the experts per MoE layer), got {value!r}")
    return tuple(counts)


def _moe_dispatch(value: Any) -> str:
    if value not in MOE_DISPATCHES:
        raise MoEConfigError(f"moe dispatch must be one of {', '.join(MOE_DISPATCHES)}, got "
                             f"{value!r}")
    return value


def _moe_type(value: Any) -> str | None:
    if value is None:
        return None
    name = getattr(value, "value", value)  # DeepSpeed's MoETypeEnum is a str enum
    if name not in MOE_TYPES:
        raise MoEConfigError(f"moe type must be one of {', '.join(MOE_TYPES)}, got {value!r}")
    return str(name)


#: Fields normalised as they are read (before the config and keyword values are compared), so
#: equal settings spelled differently agree: field → its parser.
_NORMALISERS: dict[str, Any] = {"moe": parse_moe, "offload": _parse_offload,
                                "pipeline_parallel": _parse_pipeline}
