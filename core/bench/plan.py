"""What a benchmark run measures: models × cells (batch, prompt length, new tokens) × variants,
validated cheaply before any model is loaded."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Any

from ..accelerator import Accelerator, dtype_name
from ..config import InferenceConfig, parse_dtype
from ..errors import ConfigError
from ..models import (DEFAULT_MODEL_NAME, check_model_path, default_model_path, max_positions,
                      read_config)
from .presets import get_preset

#: ``--quant`` choice → the ``quant=`` argument of ``init_inference``.
QUANT_CONFIGS = {"int8": {"weight": {"num_bits": 8}}, "int4": {"weight": {"num_bits": 4}}}
BASELINE = "hf"


def is_baseline(variant: str) -> bool:
    """Whether ``variant`` names the HF baseline (``hf``, or ``hf[grouped_mm]`` with an experts
    implementation)."""
    return variant == BASELINE or variant.startswith(BASELINE + "[")


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


@dataclass(frozen=True)
class Variant:
    """One shardwise variant: what ``init_inference`` is asked for beyond the device and the
    tensor-parallel size. ``dtype`` is a short torch name (None: the model's own); ``quant`` is
    ``"int8"``, ``"int4"`` or None; ``ep`` the expert-parallel size (``moe={"ep_size": ep}``
    when > 1: one ``--ep`` value, so ``--ep 1 2`` runs each variant both ways in one run);
    ``offload`` the tier its weights stream from (``"nvme"``, ``"cpu"`` or None: resident; the
    directory and ring size are the plan's, :meth:`Plan.offload_settings`); ``quant_head`` also
    quantizes the output head with ``quant`` (``lm_head: True``: a head tied to the input
    embeddings is stored once, quantized); ``hf_loop`` times Hugging Face's ``generate`` loop
    around the engine's step (``engine.generate(..., shardwise_fast_loop=False)``) instead of
    shardwise's own decode loop, which an injected engine's ``generate`` runs by default;
    ``weight_dtype`` (``"bf16"``/``"fp16"``) keeps the linear weights in 16 bits under the
    fp32 compute dtype (``init_inference(weight_dtype=...)``)."""

    dtype: str | None = None
    inject: bool = False
    graphs: bool = False
    quant: str | None = None
    ep: int = 1
    offload: str | None = None
    quant_head: bool = False
    hf_loop: bool = False
    weight_dtype: str | None = None

    def tags(self) -> list[str]:
        """The options as the words of the variant's name (``inject``, ``graphs``, ``int8``,
        ``offload-nvme``)."""
        return [t for t, on in (("inject", self.inject), ("graphs", self.graphs)) if on] + \
            ([self.quant] if self.quant else []) + (["head"] if self.quant_head else []) + \
            ([f"offload-{self.offload}"] if self.offload else []) + \
            (["hf-loop"] if self.hf_loop else []) + \
            ([f"{self.weight_dtype}-weights"] if self.weight_dtype else [])

    def engine_options(self) -> dict[str, Any]:
        """The ``init_inference`` keywords of these options (dtype aside)."""
        options = engine_options(self.inject, self.graphs, self.quant, self.quant_head)
        if self.weight_dtype:
            options["weight_dtype"] = self.weight_dtype
        return options


@dataclass
class Plan:
    """A validated benchmark run (built by ``shardwise bench``; see :func:`default_variants`).

    The HF baseline runs in ``baseline_dtype`` (None: each model's own dtype; the model is
    loaded in it), then each of ``variants`` runs ``init_inference`` on its own copy of the
    model (the last one on the model itself), on :meth:`world_of` ranks: one process when
    ``tp`` and the variant's ``ep`` are 1, else launched ranks (``moe_dispatch``: the
    ``dispatch`` of the expert-parallel variants)."""

    models: list[ModelSpec]
    cells: list[Cell]
    device: str
    variants: list[Variant] = field(default_factory=lambda: [Variant()])
    tp: int = 1
    nnodes: int = 1
    warmup: int = 1
    repeats: int = 3
    seed: int = 0
    baseline_dtype: str | None = None
    baseline_experts: str | None = None
    moe_dispatch: str | None = None
    nvme_path: str | None = None
    buffer_count: int | None = None
    #: pipeline stages (``--pp``) and the micro-batches each forward is split into
    pp: int = 1
    micro_batches: int = 1

    def world_of(self, variant: Variant) -> int:
        """Ranks ``variant`` runs on: :func:`world_size` of ``tp``, its ``ep`` and ``pp``."""
        return world_size(self.tp, variant.ep, self.pp)

    @property
    def world(self) -> int:
        """The most ranks a variant runs on (1: every variant runs in this process)."""
        return max((self.world_of(v) for v in self.variants),
                   default=world_size(self.tp, 1, self.pp))

    def by_world(self) -> dict[int, "Plan"]:
        """This plan split by :meth:`world_of`: ranks → the plan of the variants run on that
        many (in order), e.g. ``--ep 1 2``'s one-process variants and its 2-rank ones."""
        groups: dict[int, list[Variant]] = {}
        for variant in self.variants:
            groups.setdefault(self.world_of(variant), []).append(variant)
        return {world: dataclasses.replace(self, variants=variants)
                for world, variants in groups.items()}

    @property
    def baseline_name(self) -> str:
        """The baseline's variant name: ``hf``, or ``hf[eager]`` when HF's MoE blocks are asked
        for an experts implementation (``--baseline-experts``)."""
        return f"{BASELINE}[{self.baseline_experts}]" if self.baseline_experts else BASELINE

    def variant_name(self, variant: Variant) -> str:
        """A variant's name, its options in brackets (``shardwise[tp2,inject,graphs,int8]``,
        ``shardwise[ep2,all_to_all,inject]``: the MoE dispatch when one is asked for)."""
        ep = [f"ep{variant.ep}"] + ([self.moe_dispatch] if self.moe_dispatch else []) \
            if variant.ep > 1 else []
        pp = [f"pp{self.pp}", f"mb{self.micro_batches}"] if self.pp > 1 else []
        tags = pp + ([f"tp{self.tp}"] if self.tp > 1 else []) + ep + variant.tags()
        return f"shardwise[{','.join(tags)}]" if tags else "shardwise"

    @property
    def variant_names(self) -> list[str]:
        """The names of the shardwise variants, in run order."""
        return [self.variant_name(v) for v in self.variants]

    def engine_kwargs(self, variant: Variant) -> dict[str, Any]:
        """Keywords of ``init_inference`` for ``variant``."""
        kwargs = {"device": self.device, "dtype": variant.dtype, **variant.engine_options()}
        longest = max((c.prompt_len + c.new_tokens for c in self.cells), default=0)
        if variant.inject and longest > InferenceConfig.max_tokens:  # the static cache holds it
            kwargs["max_tokens"] = longest
        if self.tp > 1:
            kwargs["tensor_parallel"] = {"tp_size": self.tp}
        if self.pp > 1:
            kwargs["pipeline_parallel"] = {"pp_size": self.pp,
                                           "micro_batches": self.micro_batches}
        if variant.ep > 1:
            kwargs["moe"] = {"ep_size": variant.ep, **({"dispatch": self.moe_dispatch}
                                                       if self.moe_dispatch else {})}
        if variant.offload:
            kwargs["offload"] = self.offload_settings(variant.offload)
        return kwargs

    def offload_settings(self, tier: str) -> dict[str, Any]:
        """``init_inference``'s ``offload=`` for ``tier`` with this plan's directory and ring
        size (DeepSpeed's ``offload_param`` names; the unset ones left to the engine)."""
        settings = {"device": tier, "nvme_path": self.nvme_path,
                    "buffer_count": self.buffer_count}
        return {k: v for k, v in settings.items() if v is not None}

    @property
    def offload_tier(self) -> str | None:
        """The tier the offloading variants stream from (one per run), or None."""
        return next((v.offload for v in self.variants if v.offload), None)

    def check_variants(self) -> None:
        """Validate every variant's ``init_inference`` keywords with the engine's own config
        (e.g. graphs without injection), so a bad combination fails before any model loads."""
        if not self.variants:
            raise ConfigError("the plan has no shardwise variant to run")
        for variant in self.variants:
            try:
                InferenceConfig.build(**self.engine_kwargs(variant))
            except ConfigError as exc:
                raise ConfigError(f"variant {self.variant_name(variant)}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for the JSON report and the per-rank workers)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """Inverse of :meth:`to_dict`."""
        data = dict(data)
        data["models"] = [ModelSpec(**m) for m in data["models"]]
        data["cells"] = [Cell(**c) for c in data["cells"]]
        data["variants"] = [Variant(**v) for v in data["variants"]]
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


def world_size(tp: int, ep: int = 1, pp: int = 1) -> int:
    """Ranks a run with ``tp`` tensor-parallel and ``ep`` expert-parallel ranks needs: the
    smallest world that ``tp`` divides (world = tp × dp) and that ``ep`` divides (the expert
    group is carved out of the tp × dp ranks), i.e. their least common multiple: ``--ep 2``
    alone runs 2 ranks (dense parts replicated), ``--tp 2 --ep 2`` the same 2 ranks; times
    ``pp`` pipeline stages (``--pp 2 --tp 2``: 4 ranks)."""
    return pp * math.lcm(tp, ep)


def check_tp(accelerator: Accelerator, tp: int, nnodes: int = 1, ep: int = 1,
             pp: int = 1) -> int:
    """Validate ``--tp``, ``--ep`` and ``--pp`` against the ranks the nodes can host; return
    ranks per node (of the :func:`world_size` they need)."""
    if tp < 1 or nnodes < 1 or ep < 1 or pp < 1:
        raise ConfigError(f"--tp, --ep, --pp and --nnodes must be positive, got --tp {tp} --ep "
                          f"{ep} --pp {pp} --nnodes {nnodes}")
    world = world_size(tp, ep, pp)
    sizes = f"--tp {tp}" + (f" --ep {ep}" if ep > 1 else "") + (f" --pp {pp}" if pp > 1 else "")
    lower = "lower --tp" + ("/--ep" if ep > 1 else "") + ("/--pp" if pp > 1 else "")
    per_node = accelerator.max_ranks_per_node()
    if world > per_node * nnodes:
        raise ConfigError(
            f"{sizes} needs {world} ranks but {nnodes} node(s) of {accelerator.name!r} host at "
            f"most {per_node * nnodes} ({per_node} per node); {lower} or add nodes (--nnodes)")
    if world % nnodes:
        raise ConfigError(f"{sizes} ({world} ranks) does not split evenly over --nnodes {nnodes}")
    return world // nnodes


def resolve_dtype_name(accelerator: Accelerator, dtype: str | None) -> str | None:
    """``dtype`` as a short torch name after the accelerator's veto (its own error);
    ``"auto"`` → its preferred dtype; None stays None (each model's own dtype)."""
    if dtype is None:
        return None
    parsed = accelerator.preferred_dtype if dtype == "auto" else parse_dtype(dtype)
    return str(accelerator.check_dtype(parsed)).removeprefix("torch.")


#: the refusal of --quant-head without --quant (the CLI checks it first, engine_options again)
QUANT_HEAD_ALONE = "--quant-head quantizes the head with --quant's format: add --quant int8 or int4"


def engine_options(inject: bool = False, graphs: bool = False, quant: str | None = None,
                   quant_head: bool = False) -> dict[str, Any]:
    """The shardwise variant's ``init_inference`` keywords for ``--inject/--graphs/--quant``
    (and ``--quant-head``: the head quantized too)."""
    options: dict[str, Any] = {}
    if inject:
        options["replace_with_kernel_inject"] = True
    if graphs:
        options["enable_graph"] = True
    if quant is not None:
        if quant not in QUANT_CONFIGS:
            raise ConfigError(f"--quant {quant!r} is not one of {', '.join(QUANT_CONFIGS)}")
        options["quant"] = {**QUANT_CONFIGS[quant], **({"lm_head": True} if quant_head else {})}
    elif quant_head:
        raise ConfigError(QUANT_HEAD_ALONE)
    return options


def make_cells(batches: list[int], prompt_lens: list[int], new_tokens: list[int]) -> list[Cell]:
    """Every combination of the three lists (all values must be positive)."""
    for name, values in (("--batch", batches), ("--prompt-len", prompt_lens),
                         ("--new-tokens", new_tokens)):
        if any(v < 1 for v in values):
            raise ConfigError(f"{name} values must be positive integers, got {values}")
    return [Cell(b, p, n) for b in batches for p in prompt_lens for n in new_tokens]


#: The weight the quant-kernel probe asks about: a square linear of a small model's width.
PROBE_FEATURES = 1024


def fast_quant_dtype(accelerator: Accelerator, quant: str,
                     dtypes: list[str | None]) -> str | None:
    """The first of ``dtypes`` (short names) in which a kernel backend of ``accelerator`` other
    than the torch reference takes a ``quant`` weight (default settings, a
    ``PROBE_FEATURES``-square linear), or None: the registry is asked, never a device name."""
    from ..kernel_registry import REFERENCE, registry
    from ..quant.config import parse_quant

    config = parse_quant(QUANT_CONFIGS[quant])
    group_size = config.group_size_for("probe", PROBE_FEATURES)
    shape = dict(bits=config.bits, group_size=group_size, symmetric=config.symmetric,
                 in_features=PROBE_FEATURES, out_features=PROBE_FEATURES)
    for name in dict.fromkeys(d for d in dtypes if d is not None):
        impl = registry.resolve("quant_linear", accelerator, parse_dtype(name), **shape)
        if impl.backend != REFERENCE:
            return name
    return None


def default_variants(accelerator: Accelerator) -> tuple[list[Variant], list[str]]:
    """The variants ``shardwise bench`` runs without variant options: what shardwise does
    fastest on this device, asked of the accelerator: kernel injection in its preferred dtype,
    with graphs when its graph strategy accelerates anything; then int8 and int4 weights, each
    in the first dtype (the preferred one first) that has a fast ``quant_linear`` kernel.
    Returns ``(variants, notes)``; a note says why a quantized row is left out."""
    dtype = dtype_name(accelerator.preferred_dtype)
    graphs = accelerator.graph_strategy().accelerates
    variants = [Variant(dtype, inject=True, graphs=graphs)]
    notes = []
    supported = [dtype_name(d) for d in accelerator.supported_dtypes]
    for quant in QUANT_CONFIGS:
        kernel_dtype = fast_quant_dtype(accelerator, quant, [dtype, *supported])
        if kernel_dtype is None:
            notes.append(f"no {quant} row: no kernel backend of {accelerator.name!r} has a fast "
                         f"{quant} quant_linear kernel in {', '.join(supported)}")
            continue
        variants.append(Variant(kernel_dtype, inject=True, graphs=graphs, quant=quant))
    return variants, notes


def model_positions(spec: ModelSpec) -> int | None:
    """The position-table size of ``spec`` when it is cheap to know (a preset's config, a HF
    directory's config.json); None for GGUF files and models that do not say."""
    from pathlib import Path

    if spec.kind == "preset":
        return max_positions(get_preset(spec.name).config)
    if spec.path and Path(spec.path).is_dir():
        try:
            return max_positions(read_config(Path(spec.path)))
        except ConfigError:  # an unreadable config.json is named when the model loads
            return None
    return None


def check_cells_fit(models: list[ModelSpec], cells: list[Cell]) -> None:
    """Refuse cells longer (prompt + new tokens) than a model's positions, before any load."""
    longest = max(cells, key=lambda c: c.prompt_len + c.new_tokens)
    for spec in models:
        limit = model_positions(spec)
        if limit is not None and longest.prompt_len + longest.new_tokens > limit:
            raise ConfigError(
                f"--prompt-len {longest.prompt_len} + --new-tokens {longest.new_tokens} exceed "
                f"the {limit} positions of {spec.name}; use shorter prompts or fewer tokens")


# ----- HF's experts implementations (MoE baselines) -----------------------------------------------

#: config.json keys that give an MoE model's number of routed experts, in HF's families.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def experts_implementations() -> list[str]:
    """The experts implementations this transformers knows (``experts_implementation=``):
    ``eager`` (a Python loop over the experts hit) and those of its ``ALL_EXPERTS_FUNCTIONS``
    (``grouped_mm``, ``batched_mm``, ...)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ["eager", *ALL_EXPERTS_FUNCTIONS.keys()]


def model_experts(spec: ModelSpec) -> int | None:
    """Routed experts of ``spec`` from its config (0: a dense model); None when that is not
    cheap to know (a GGUF file, the embedded default model)."""
    from pathlib import Path

    if spec.kind == "preset":
        config = get_preset(spec.name).config
    elif spec.kind == "path" and spec.path and Path(spec.path).is_dir():
        config = read_config(Path(spec.path))
    else:
        return None
    return max((v for k in EXPERT_COUNT_KEYS if isinstance(v := config.get(k), int)), default=0)


def check_baseline_experts(models: list[ModelSpec], experts: str | None,
                           accelerator: Accelerator, dtype: str | None) -> None:
    """Refuse ``--baseline-experts`` before any load: an implementation this transformers does
    not know, a model that is not MoE (or cannot be told to be), or an implementation that does
    not run on ``accelerator``'s device in ``dtype`` (tried on a tiny experts module there)."""
    if experts is None:
        return
    known = experts_implementations()
    if experts not in known:
        raise ConfigError(f"--baseline-experts {experts!r} is not an experts implementation of "
                          f"this transformers; choose one of {', '.join(known)}")
    _require_moe_models(models, f"--baseline-experts {experts}", "picks how HF's MoE blocks run "
                        "their experts")
    probe_experts_implementation(experts, accelerator, parse_dtype(dtype))


def probe_experts_implementation(experts: str, accelerator: Accelerator, dtype) -> None:
    """Run HF's ``experts`` implementation once on a tiny Mixtral experts module (4 experts,
    hidden 16) on ``accelerator``'s device in ``dtype``; a ConfigError names it and its own
    error when it does not run there (e.g. a GPU-only kernel, a missing package)."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=16, intermediate_size=32, num_local_experts=4,
                           num_experts_per_tok=2)
    config._experts_implementation = experts
    dtype = dtype or torch.float32
    device = accelerator.device()
    try:
        module = MixtralExperts(config).to(device=device, dtype=dtype)
        torch.nn.init.normal_(module.gate_up_proj)
        torch.nn.init.normal_(module.down_proj)
        hidden = torch.randn(3, 16, device=device, dtype=dtype)  # 3 tokens
        index = torch.tensor([[0, 1], [1, 2], [3, 0]], device=device)  # (tokens, top_k)
        module(hidden, index, torch.full((3, 2), 0.5, device=device, dtype=dtype))
    except Exception as exc:  # the implementation's own reason (ImportError, ValueError, ...)
        raise ConfigError(f"--baseline-experts {experts} does not run on {accelerator.name!r} "
                          f"in {dtype_name(dtype)} ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}); choose another of "
                          f"{', '.join(experts_implementations())}") from None


# ----- --ep and --tp against each model (MoE, expert parallelism) -------------------------------

def check_expert_parallel(models: list[ModelSpec], ep: int, dispatch: str | None = None) -> None:
    """Refuse ``--ep`` > 1 (or ``--moe-dispatch``) before any load for a model that is not MoE
    (or cannot be told to be: a GGUF file, the embedded default) and for an ``--ep`` larger
    than a model's expert count (each expert-parallel rank needs at least one expert)."""
    if ep <= 1 and dispatch is None:  # (ep < 1: check_tp names it)
        return
    option = f"--ep {ep}" if ep > 1 else f"--moe-dispatch {dispatch}"
    _require_moe_models(models, option, "splits the experts of a Mixture-of-Experts model over "
                        "ranks")
    for spec in models:
        count = model_experts(spec)
        if ep > count:
            raise ConfigError(f"--ep {ep} is more than the {count} experts of {spec.name} "
                              f"(each expert-parallel rank needs at least one); use --ep "
                              f"{count} or less")


def meta_model(spec: ModelSpec):
    """``spec``'s model built on the meta device (no memory, no weights read), for the
    engine's own plan checks; None when that is not cheap (a GGUF file, the embedded default,
    a directory whose config transformers cannot build)."""
    from pathlib import Path

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if spec.kind == "preset":
        config = get_preset(spec.name).hf_config()
    elif spec.kind == "path" and spec.path and Path(spec.path).is_dir():
        try:
            config = AutoConfig.from_pretrained(spec.path)
        except Exception:  # noqa: BLE001 — the load names it, with the whole story
            return None
    else:
        return None
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 — as above
        return None


def check_parallel_plans(models: list[ModelSpec], tp: int, ep: int, pp: int = 1) -> None:
    """Every model's plan on :func:`world_size` ranks, built by the engine's own
    :func:`~shardwise.plan.build_plan` on a meta-device copy (nothing loaded): sizes that do
    not fit (``--ep`` not dividing the ranks, heads ``--tp`` cannot split, data-parallel
    replicas of a tensor-parallel group, a dimension not supported yet) fail here with the
    engine's message, before the bandwidth probe, any load or any launch. Models that cannot
    be built on the meta device cheaply are checked by the engine when they load."""
    if tp == 1 and ep == 1 and pp == 1:
        return
    from ..config import parse_moe
    from ..pipeline import parse_pipeline
    from ..plan import build_plan

    world = world_size(tp, ep, pp)
    moe = parse_moe({"ep_size": ep}) if ep > 1 else None
    pipeline = parse_pipeline({"pp_size": pp}) if pp > 1 else None
    sizes = (f"--tp {tp}" + (f" --ep {ep}" if ep > 1 else "") + (f" --pp {pp}" if pp > 1 else "")
             + f" ({world} ranks)")
    for spec in models:
        model = meta_model(spec)
        if model is None:
            continue
        try:
            build_plan(model, tp_size=tp, world=world, rank=0, moe=moe, pipeline=pipeline)
        except ConfigError as exc:
            raise ConfigError(f"{sizes} on {spec.name}: {exc}") from None


def _require_moe_models(models, option: str, does: str) -> None:
    """Every benched model is a Mixture-of-Experts one whose config is at hand, else a
    ConfigError naming ``option`` (what ``does``) and the model."""
    flag = option.split()[0]
    for spec in models:
        count = model_experts(spec)
        if count is None:
            raise ConfigError(f"{option} needs an MoE model, and {spec.name} is not a preset or "
                              f"HF directory whose config says; bench an MoE preset "
                              f"(--list-presets) or directory, or drop {flag}")
        if count == 0:
            raise ConfigError(f"{option} {does}, and {spec.name} is a dense model (no experts); "
                              f"drop {flag} or bench an MoE model (e.g. --preset "
                              f"mixtral-18l-1024h-8e)")


# ----- --offload ----------------------------------------------------------------------------------

#: The engine's names for the offload settings, and the bench options that set them (named
#: after an engine message that speaks of them).
OFFLOAD_OPTIONS = {"nvme_path": "--nvme-path", "buffer_count": "--buffer-count",
                   "enable_graph": "--graphs"}


def check_offload_variants(plan: Plan, accelerator: Accelerator) -> None:
    """Every offloading variant's settings against this machine, before any load: the engine's
    own checks (:func:`shardwise.offload.config.check_offload`: ``--nvme-path`` given for the
    ``nvme`` tier, an existing writable directory; ``--buffer-count`` at least 2; the ``cpu``
    tier only on a device with memory of its own; ``--graphs`` only where the graph strategy
    can capture one layer at a time), their errors prefixed with
    the ``--offload`` option and the bench options the message's settings are."""
    from ..offload.config import check_offload, parse_offload

    for variant in plan.variants:
        if not variant.offload:
            continue
        try:
            settings = parse_offload(plan.offload_settings(variant.offload))
            check_offload(settings, accelerator, None, accelerator.device(),
                          enable_graph=variant.graphs)
        except ConfigError as exc:
            text = str(exc)
            named = [f"{key} is {flag}" for key, flag in OFFLOAD_OPTIONS.items() if key in text]
            raise ConfigError(f"--offload {variant.offload}: {text}"
                              + (f" (here {', '.join(named)})" if named else "")) from None
