"""Policies: per-family data that tells the one generic sharding mechanism how a family is laid out.

A policy is *data only* — a subclass of :class:`Policy` that sets class attributes — registered in
the ``shardwise.policies`` entry-point group and found by the model config's ``model_type``::

    [project.entry-points."shardwise.policies"]
    llama = "shardwise.policies.llama:LlamaPolicy"

Adding a model family is adding one such module (see ``policies/llama.py``, ``policies/gpt2.py``).
The applier (:mod:`shardwise.sharding.apply`) reads:

``tp_plan``           pattern → :class:`~shardwise.sharding.roles.Role`; the policy's own plan, used
                      when neither the user nor the model (HF ``tp_plan``) gives a usable one.
``layouts``           pattern → :class:`~shardwise.sharding.roles.Layout`; how each sharded
                      module's split dimension is organised (heads, fused q|k|v …), applied whatever
                      plan chose the role (user, HF, policy). Unlisted modules split ``Even()``.
``attention_modules`` patterns of the attention modules whose attributes must follow the split.
``attention_attrs``   attribute name → per-rank quantity (``q_heads``, ``kv_heads``, ``kv_groups``,
                      ``head_dim``, ``q_width``, ``kv_width``, ``qkv_width``), set on each attention
                      module *instance* so the unchanged HF forward runs on the rank's heads.
``attention_config_attrs`` config attribute → per-rank quantity, for forwards that read head
                      counts from ``self.config`` (Phi-3): each attention instance gets its own
                      :class:`~shardwise.sharding.apply.ConfigView` of the shared config with these
                      attributes overridden; the model's config is untouched.
``attention_head_params`` attribute → ``"heads"`` or ``"kv_heads"``: a parameter of each attention
                      module with one entry per head along dim 0 (GPT-OSS's ``sinks``), sliced to
                      the rank's heads under TP (undone by close()).
``head_sliced_inputs`` pattern → :class:`~shardwise.sharding.inputs.HeadSlicedInput` s: forward
                      arguments built above the module for all heads (BLOOM's ALiBi ``alibi``),
                      narrowed to the rank's heads by an instance pre-hook on each matching module.
``head_config``       which config attributes hold the head counts (tried in order); an entry may
                      be an :class:`IfConfig` (a value that holds only for some configs).
``moe_config``        which config attributes hold the Mixture-of-Experts facts (expert count, top-k,
                      shared experts) and ``moe_layer_rules``, which say which layers are MoE
                      (:meth:`Policy.moe_facts`); the defaults read every HF MoE family's names.
``moe``               a :class:`~shardwise.moe.MoESpec`: where the MoE block's router, experts and
                      shared expert are and how the router scores (None: no MoE support).
``injection``         an :class:`~shardwise.inject.InjectionSpec` (norm kind, positions, MLP kind,
                      fused layouts, module names) read by the kernel injector
                      (:mod:`shardwise.inject`); None: the family has no kernel injection.

Patterns are dotted module names where ``*`` matches one name segment; they match a module's full
name or its name below the base model (``layers.*.self_attn.q_proj`` matches
``model.layers.0.self_attn.q_proj`` in a ``LlamaForCausalLM``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from .accelerator import PLUGIN_API_VERSION
from .layout import HeadCounts, Heads, Layout, Role, ShardingError  # leaf: no sharding import


class Policy:
    """Base class of model-family policies (data only; see the module docstring).

    Class attributes:
        name: short name shown in reports.
        model_types: HF ``config.model_type`` values the policy covers.
        tp_plan: the policy's tensor-parallel plan, pattern → Role (ordered; first match wins).
        layouts: pattern → Layout of the split dimension of sharded modules.
        attention_modules: patterns of attention modules whose attributes follow the split.
        attention_attrs: attribute → head quantity (see :meth:`HeadPartition.quantity`).
        attention_config_attrs: attribute of the attention module's ``config`` → head quantity,
            overridden in a per-instance view of the shared config (empty: config untouched).
        require_attention_attrs: a listed attribute missing on an attention module is an error
            (True for family policies; the generic fallback sets only those present).
        head_sliced_inputs: pattern → tuple of :class:`~shardwise.sharding.inputs.HeadSlicedInput`
            (forward arguments holding every head's entry, narrowed to the rank's heads).
        head_config: ``num_heads`` / ``num_kv_heads`` / ``head_dim`` / ``hidden_size`` → config
            attribute names (or :class:`IfConfig` values) tried in order. A missing kv count
            means multi-head attention; a missing head_dim means hidden_size // num_heads.
    """

    plugin_api_version: ClassVar[int] = PLUGIN_API_VERSION
    name: ClassVar[str] = "base"
    model_types: ClassVar[tuple[str, ...]] = ()
    tp_plan: ClassVar[dict[str, Role]] = {}
    layouts: ClassVar[dict[str, Layout]] = {}
    attention_modules: ClassVar[tuple[str, ...]] = ()
    attention_attrs: ClassVar[dict[str, str]] = {}
    attention_config_attrs: ClassVar[dict[str, str]] = {}
    attention_head_params: ClassVar[dict[str, str]] = {}
    head_sliced_inputs: ClassVar[dict[str, tuple]] = {}
    require_attention_attrs: ClassVar[bool] = True
    #: the MoE block's layout (a shardwise.moe.MoESpec), None for a dense family
    moe: ClassVar[Any] = None
    #: kernel-injection data (a shardwise.inject.InjectionSpec), None when not supported
    injection: ClassVar[Any] = None
    #: config-dependent variants of ``injection``: ``(when, changes)`` rows, applied in order to
    #: the spec (``dataclasses.replace``) wherever every ``config.<attr> == value`` in ``when``;
    #: a change replaces a whole field or group (``{"positions": Positions("alibi")}``)
    injection_overrides: ClassVar[tuple[tuple[Mapping[str, Any], Mapping[str, Any]], ...]] = ()
    head_config: ClassVar[dict[str, tuple[str, ...]]] = {
        "num_heads": ("num_attention_heads",),
        "num_kv_heads": ("num_key_value_heads",),
        "head_dim": ("head_dim",),
        "hidden_size": ("hidden_size",),
    }

    #: MoE fact → config attributes tried in order (:meth:`moe_facts`). ``shared_experts`` is a
    #: count; ``shared_expert_size`` a width (> 0: one shared expert) read when no count is given.
    moe_config: ClassVar[dict[str, tuple[str, ...]]] = {
        "num_experts": ("num_local_experts", "num_experts", "n_routed_experts"),
        "top_k": ("num_experts_per_tok", "experts_per_token", "moe_topk"),
        "shared_experts": ("n_shared_experts", "num_shared_experts"),
        "shared_expert_size": ("shared_expert_intermediate_size",),
        "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
        "num_groups": ("n_group",),
        "top_groups": ("topk_group",),
    }
    #: ``(config attribute, rule)``: which layers are MoE; a layer is MoE when every rule whose
    #: attribute the config sets says so (rules: :data:`MOE_LAYER_RULES`).
    moe_layer_rules: ClassVar[tuple[tuple[str, str], ...]] = (
        ("first_k_dense_replace", "dense_before"),   # DeepSeek: the first k layers are dense
        ("mlp_only_layers", "dense_listed"),         # Qwen-MoE: these layers are dense
        ("decoder_sparse_step", "every_nth"),        # Qwen-MoE: every n-th layer is MoE
    )

    def head_counts(self, config: Any) -> HeadCounts | None:
        """(num_heads, num_kv_heads, head_dim) read from ``config`` through :attr:`head_config`;
        None when the config has no head count (the model then cannot use head layouts)."""
        if config is None:
            return None
        num_heads = first_config_value(config, self.head_config.get("num_heads", ()))
        if not num_heads:
            return None
        num_kv = first_config_value(config, self.head_config.get("num_kv_heads", ())) or num_heads
        head_dim = first_config_value(config, self.head_config.get("head_dim", ()))
        if not head_dim:
            hidden = first_config_value(config, self.head_config.get("hidden_size", ()))
            if not hidden:
                return None
            head_dim = hidden // num_heads
        return HeadCounts(int(num_heads), int(num_kv), int(head_dim))

    def moe_facts(self, config: Any) -> "MoEFacts | None":
        """The model's Mixture-of-Experts facts read from ``config`` through :attr:`moe_config`
        and :attr:`moe_layer_rules`; None for a dense model (no positive expert count)."""
        if config is None:
            return None
        total = first_config_value(config, self.moe_config.get("num_experts", ()))
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            return None
        top_k = first_config_value(config, self.moe_config.get("top_k", ()))
        shared = first_config_value(config, self.moe_config.get("shared_experts", ()))
        if shared is None:  # one shared expert of that width (Qwen2-MoE), or none
            shared = int(bool(first_config_value(config, self.moe_config.get("shared_expert_size", ()))))
        layers = first_config_value(config, self.moe_config.get("num_layers", ())) or 0
        rules = [(MOE_LAYER_RULES[kind], getattr(config, attr))
                 for attr, kind in self.moe_layer_rules if getattr(config, attr, None) is not None]
        moe_layers = tuple(i for i in range(int(layers)) if all(rule(i, v) for rule, v in rules))
        num_groups = first_config_value(config, self.moe_config.get("num_groups", ())) or 1
        top_groups = first_config_value(config, self.moe_config.get("top_groups", ())) or num_groups
        groups = (int(num_groups), int(top_groups)) if num_groups > 1 else None
        return MoEFacts(total, int(top_k) if top_k else 1, int(shared), moe_layers, groups)

    def injection_spec(self, config: Any) -> Any:
        """:attr:`injection` with the :attr:`injection_overrides` that ``config`` selects."""
        spec = self.injection
        for when, changes in self.injection_overrides:
            if spec is not None and all(getattr(config, k, None) == v for k, v in when.items()):
                spec = dataclasses.replace(spec, **changes)
        return spec

    def __repr__(self) -> str:
        return f"<policy {self.name} for {', '.join(self.model_types) or 'any model'}>"


@dataclass(frozen=True)
class MoEFacts:
    """A Mixture-of-Experts model's facts, read from its config (:meth:`Policy.moe_facts`).

    Attributes:
        num_experts: routed experts per MoE layer.
        top_k: experts each token is routed to.
        shared: always-on shared experts per MoE layer (0: none).
        moe_layers: indices of the decoder layers whose MLP is the MoE block.
        groups: group-limited routing ``(expert groups, groups each token may use)``
            (DeepSeek-V3's ``n_group`` / ``topk_group``); None: plain top-k.
    """

    num_experts: int
    top_k: int
    shared: int
    moe_layers: tuple[int, ...]
    groups: tuple[int, int] | None = None


#: rule name → (layer index, config value) → whether the layer is MoE (``Policy.moe_layer_rules``)
MOE_LAYER_RULES = {
    "dense_before": lambda i, k: i >= k,
    "dense_listed": lambda i, dense: i not in dense,
    "every_nth": lambda i, n: n > 0 and (i + 1) % n == 0,
}


@dataclass(frozen=True)
class IfConfig:
    """A ``head_config`` entry that is a value, used only when every config attribute in
    ``when`` has the given value (else the next entry is tried): Falcon's older multi-query
    layout has ONE kv head whatever ``num_kv_heads`` says, so its policy lists
    ``IfConfig(1, {"multi_query": True, "new_decoder_architecture": False})`` before
    ``"num_kv_heads"``."""

    value: Any
    when: Mapping[str, Any]

    def applies(self, config: Any) -> bool:
        return all(getattr(config, k, None) == v for k, v in self.when.items())


def first_config_value(config: Any, names: tuple[str, ...]) -> Any:
    """The first of the config attributes ``names`` that is set (not None), or None; an entry may
    be an :class:`IfConfig` (its value, where its condition holds)."""
    for name in names:
        if isinstance(name, IfConfig):
            if name.applies(config):
                return name.value
            continue
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


class GenericPolicy(Policy):
    """The fallback for a model type no policy claims: HF's standard attention names (the
    ``q_proj``/``k_proj``/``v_proj``/``o_proj`` of Llama-like decoders). It never supplies a plan
    of its own; it only gives layouts and attention attributes to a plan from elsewhere."""

    name = "generic"
    layouts = {
        "layers.*.self_attn.q_proj": Heads("heads"),
        "layers.*.self_attn.k_proj": Heads("kv_heads"),
        "layers.*.self_attn.v_proj": Heads("kv_heads"),
        "layers.*.self_attn.o_proj": Heads("heads"),
    }
    attention_modules = ("layers.*.self_attn",)
    attention_attrs = {"num_key_value_groups": "kv_groups", "num_heads": "q_heads",
                       "num_key_value_heads": "kv_heads"}
    require_attention_attrs = False


def find_policy(model_type: str | None) -> Policy | None:
    """The registered policy whose ``model_types`` contains ``model_type`` (None if none does).
    A third-party policy beats a built-in one; two of the same kind claiming it is an error."""
    from .plugins import policy_plugins

    if not model_type:
        return None
    claims = []
    for name, record in sorted(policy_plugins().records.items()):
        cls = record.obj if record.loaded else None
        if isinstance(cls, type) and issubclass(cls, Policy) and model_type in cls.model_types:
            claims.append((not record.builtin, name, cls))
    if not claims:
        return None
    claims.sort(key=lambda c: c[0], reverse=True)
    if len(claims) > 1 and claims[0][0] == claims[1][0]:
        raise ShardingError(f"policies {claims[0][1]!r} and {claims[1][1]!r} both claim "
                            f"model_type {model_type!r}; uninstall one")
    return claims[0][2]()


def policy_for(model: Any) -> Policy | None:
    """The registered policy for ``model`` (by ``model.config.model_type``), or None."""
    return find_policy(getattr(getattr(model, "config", None), "model_type", None))
