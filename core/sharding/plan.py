"""Sharding plans: ordered rows ``pattern → Role``, and where a plan comes from.

A pattern is a dotted module name in which ``*`` matches exactly one name segment
(``layers.*.mlp.down_proj``). It matches a module's full name, or its name below the model's base
model (``base_model_prefix``), so HF's ``base_model_tp_plan`` patterns and policy patterns work on
both ``LlamaModel`` and ``LlamaForCausalLM``. The first row that matches a module decides its role.

:func:`choose_plan` picks the plan, in this order:

1. the user's ``injection_policy`` (DeepSpeed's ``{BlockClass: ("row.linear", ...)}``, or a
   ``{pattern: role}`` dict); every name in it must exist;
2. the model's own HF tensor-parallel plan (``model._tp_plan``, else
   ``config.base_model_tp_plan``) when every entry it uses can be applied faithfully;
3. the registered policy's ``tp_plan``;
4. a structural heuristic (no names): in each block of a ``ModuleList``, a module with 2–4
   direct linear children that read the same width ``d``, the last of which writes ``d`` back
   from a width one of the others produces, is an "open → close" group: the others
   column-parallel, the last row-parallel. It cannot see fused layouts (left replicated) nor
   tell a q/k/v-only module from a pair (BERT's self-attention); families like that need a
   policy.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import nn

from .errors import ShardingError
from .roles import (ROLE_NAMES, ColumnParallel, Replicated, Role, RowParallel,
                    VocabParallelEmbedding, VocabParallelHead)

if TYPE_CHECKING:
    from ..policy import Policy


# ----- patterns -----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str) -> re.Pattern:
    parts = ["[^.]+" if seg == "*" else re.escape(seg) for seg in pattern.split(".")]
    return re.compile(r"\.".join(parts))


def base_prefix(model: nn.Module) -> str:
    """The name of the model's base-model submodule (``"model"``, ``"transformer"``) or ``""``."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    return prefix if isinstance(getattr(model, prefix, None), nn.Module) else ""


def pattern_matches(pattern: str, name: str, prefix: str = "") -> bool:
    """Whether ``pattern`` matches module ``name`` in full, or below the base-model ``prefix``."""
    regex = _compiled(pattern)
    if regex.fullmatch(name):
        return True
    return bool(prefix) and name.startswith(prefix + ".") and bool(
        regex.fullmatch(name[len(prefix) + 1:]))


def first_match(table: Mapping[str, Any], name: str, prefix: str = "") -> Any:
    """The value of the first pattern in ``table`` that matches ``name`` (None if none does)."""
    for pattern, value in table.items():
        if pattern_matches(pattern, name, prefix):
            return value
    return None


# ----- the plan -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlanRow:
    pattern: str
    role: Role


@dataclass
class ShardingPlan:
    """Ordered rows ``pattern → Role``.

    Attributes:
        rows: the rows, first match wins.
        source: where it came from (``injection_policy``, ``hf_tp_plan``, ``policy:<name>``,
            ``heuristic``, or what the caller says).
        strict: every row must match at least one module (user plans), else
            :class:`ShardingError` names the rows that match nothing.
        notes: remarks for the report (e.g. why an HF plan was not used).
    """

    rows: list[PlanRow]
    source: str = "user"
    strict: bool = True
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], source: str = "user",
                     strict: bool = True) -> "ShardingPlan":
        """A plan from ``{pattern: role}``; a role is a :class:`Role`, a Role class, or a name
        (``"colwise"``, ``"rowwise"``, ``"vocab_embedding"``, ``"vocab_head"``,
        ``"replicated"``; see :data:`ROLE_NAMES`)."""
        return cls([PlanRow(p, as_role(r, p)) for p, r in mapping.items()], source, strict)

    def role_for(self, name: str, prefix: str = "") -> Role | None:
        for row in self.rows:
            if pattern_matches(row.pattern, name, prefix):
                return row.role
        return None

    def resolve(self, model: nn.Module) -> dict[str, Role]:
        """Module name → role for every module some row matches, in model order. A strict plan
        with rows that match nothing raises, naming them (with the closest module names)."""
        prefix = base_prefix(model)
        names = [n for n, _ in model.named_modules() if n]
        out, used = {}, set()
        for name in names:
            for i, row in enumerate(self.rows):
                if pattern_matches(row.pattern, name, prefix):
                    out[name] = row.role
                    used.add(i)
                    break
        missing = [r.pattern for i, r in enumerate(self.rows) if i not in used]
        if missing and self.strict:
            raise ShardingError(_missing_message(missing, names, self.source))
        if missing:
            self.notes.append(f"rows matching no module: {', '.join(missing)}")
        return out


def as_role(value: Any, pattern: str = "?") -> Role:
    """A :class:`Role` from a Role, a Role class or a role name."""
    if isinstance(value, Role):
        return value
    if isinstance(value, type) and issubclass(value, Role):
        return value()
    if isinstance(value, str) and value in ROLE_NAMES:
        return ROLE_NAMES[value]()
    raise ShardingError(f"plan row {pattern!r}: {value!r} is not a role; use a "
                        f"shardwise.sharding Role or one of {', '.join(ROLE_NAMES)}")


def _missing_message(missing: list[str], names: list[str], source: str) -> str:
    hints = []
    for pattern in missing:
        close = difflib.get_close_matches(pattern, names, n=1, cutoff=0.6)
        hints.append(f"{pattern!r}" + (f" (closest module: {close[0]!r})" if close else ""))
    return (f"the {source} plan names module(s) that do not exist in the model: "
            f"{'; '.join(hints)}")


# ----- source 1: the user's injection_policy ------------------------------------------------------

def linear_like(module: nn.Module) -> bool:
    """nn.Linear or transformers' Conv1D (a linear with a transposed [in, out] weight)."""
    if isinstance(module, nn.Linear):
        return True
    conv1d = _conv1d_class()
    return conv1d is not None and isinstance(module, conv1d)


@functools.cache
def _conv1d_class():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is a dependency; a stripped install only loses Conv1D
        return None
    return Conv1D


def plan_from_injection_policy(model: nn.Module, injection_policy: Mapping) -> ShardingPlan:
    """The user's plan. ``{BlockClass: ("self_attn.o_proj", "mlp.down_proj")}`` (DeepSpeed's
    format): in every instance of ``BlockClass`` the named linears are row-parallel and every
    other linear is column-parallel. A dict with string keys is a ``{pattern: role}`` plan.
    Names that do not exist fail, named."""
    if not isinstance(injection_policy, Mapping) or not injection_policy:
        raise ShardingError(f"injection_policy must be a non-empty dict like "
                            f"{{LlamaDecoderLayer: ('self_attn.o_proj', 'mlp.down_proj')}}, got "
                            f"{injection_policy!r}")
    if all(isinstance(k, str) for k in injection_policy):
        return ShardingPlan.from_mapping(injection_policy, "injection_policy", strict=True)
    rows: list[PlanRow] = []
    for block_cls, row_names in injection_policy.items():
        rows += _block_rows(model, block_cls, row_names)
    return ShardingPlan(rows, "injection_policy", strict=True)


def _block_rows(model: nn.Module, block_cls: Any, row_names: Any) -> list[PlanRow]:
    if not isinstance(block_cls, type):
        raise ShardingError(f"injection_policy key {block_cls!r} must be a module class (or all "
                            f"keys must be pattern strings)")
    row_names = (row_names,) if isinstance(row_names, str) else tuple(row_names)
    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, block_cls)]
    if not blocks:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ShardingError(f"injection_policy names {block_cls.__name__}, but the model has no "
                            f"module of that class (classes in it: {', '.join(present)})")
    rows = []
    for block_name, block in blocks:
        linears = [n for n, m in block.named_modules() if n and linear_like(m)]
        missing = [r for r in row_names if r not in linears]
        if missing:
            raise ShardingError(
                f"injection_policy for {block_cls.__name__} names {', '.join(map(repr, missing))}, "
                f"which is not a linear layer of {block_name!r}; its linear layers are: "
                f"{', '.join(linears) or 'none'}")
        rows += [PlanRow(f"{block_name}.{r}", RowParallel()) for r in row_names]
        rows += [PlanRow(f"{block_name}.{n}", ColumnParallel()) for n in linears
                 if n not in row_names]
    return rows


# ----- source 2: the model's own HF tp_plan -------------------------------------------------------

#: HF tp_plan styles shardwise applies faithfully, by module kind. Any other style (e.g.
#: ``colwise_gather_output`` on a fused qkv, ``rowwise_split_input``, ``packed_colwise``, MoE
#: styles) makes the whole HF plan defer to the policy's plan.
_HF_LINEAR = {"colwise": ColumnParallel, "rowwise": RowParallel, "replicated": Replicated}
_HF_EMBEDDING = {"embedding_rowwise": VocabParallelEmbedding, "rowwise": VocabParallelEmbedding,
                 "replicated": Replicated}
_HF_HEAD = {"colwise_gather_output": VocabParallelHead, "colwise_rep": VocabParallelHead,
            "colwise": VocabParallelHead, "replicated": Replicated}


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's HF plan: the instance's ``_tp_plan`` (full names, LM head included) when set,
    else ``config.base_model_tp_plan``."""
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, Mapping) and own:
        return dict(own)
    return dict(getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {})


def plan_from_hf(model: nn.Module) -> tuple[ShardingPlan | None, str]:
    """(the translated HF plan, "") or (None, why it is not used)."""
    raw = hf_tp_plan(model)
    if not raw:
        return None, "the model has no HF tp_plan"
    prefix = base_prefix(model)
    modules = [(n, m) for n, m in model.named_modules() if n]
    output = _output_embeddings(model)
    get_input = getattr(model, "get_input_embeddings", None)
    # the vocab tables: a plan that splits only these leaves every block whole
    tables = {id(output), id(get_input() if callable(get_input) else None)}
    rows, unusable, beyond_head = [], [], False
    for pattern, style in raw.items():
        matched = [m for n, m in modules if pattern_matches(pattern, n, prefix)]
        role = _translate_hf(style, matched, output)
        if role is None:
            unusable.append(f"{pattern}: {style}")
        elif matched:
            rows.append(PlanRow(pattern, role))
            beyond_head = beyond_head or any(id(m) not in tables for m in matched)
    if unusable:
        return None, (f"the model's HF tp_plan uses entries shardwise cannot apply faithfully "
                      f"({'; '.join(unusable)})")
    if not rows:
        return None, "the model's HF tp_plan matches no module"
    if not beyond_head:  # GPT-OSS: only the LM head (transformers 4.x) or embeddings (5.x)
        return None, ("the model's HF tp_plan splits only its vocab tables (embeddings, LM "
                      "head), none of its blocks: it would leave the attention whole")
    return ShardingPlan(rows, "hf_tp_plan", strict=False), ""


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    try:
        return getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        return None


def _translate_hf(style: str, matched: list[nn.Module], output: nn.Module | None) -> Role | None:
    if not matched:
        return Replicated()  # nothing to apply; harmless
    if all(m is output for m in matched):
        table = _HF_HEAD
    elif all(isinstance(m, nn.Embedding) for m in matched):
        table = _HF_EMBEDDING
    elif all(linear_like(m) for m in matched):
        table = _HF_LINEAR
    else:
        return None
    cls = table.get(style)
    return cls() if cls else None


# ----- source 3: a policy; source 4: the heuristic ------------------------------------------------

def plan_from_policy(policy: "Policy | None") -> ShardingPlan | None:
    if policy is None or not policy.tp_plan:
        return None
    return ShardingPlan.from_mapping(policy.tp_plan, f"policy:{policy.name}", strict=False)


def heuristic_plan(model: nn.Module) -> ShardingPlan | None:
    """The structural last resort (see the module docstring). Fused projections (whose output
    width matches no closing input) are left replicated, since their layout cannot be seen."""
    rows = []
    for _, blocks in ((n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)):
        for block in blocks:
            for parent in block.modules():
                rows += _open_close_rows(model, parent)
    unique = list({row.pattern: row for row in rows}.values())  # nested ModuleLists repeat
    return ShardingPlan(unique, "heuristic", strict=True) if unique else None


def _open_close_rows(model: nn.Module, parent: nn.Module) -> list[PlanRow]:
    children = [m for m in parent.children() if linear_like(m)]
    if not 2 <= len(children) <= 4:  # q,k,v,o / gate,up,down / fc1,fc2; more is not a pair
        return []
    *opens, close = children
    dims = [_in_out(m) for m in children]
    width = dims[0][0]
    open_outs = {out for _, out in dims[:-1]}
    close_in, close_out = dims[-1]
    if any(d[0] != width for d in dims[:-1]) or close_out != width or close_in not in open_outs:
        return []
    names = {id(m): n for n, m in model.named_modules()}
    return ([PlanRow(names[id(m)], ColumnParallel()) for m in opens]
            + [PlanRow(names[id(close)], RowParallel())])


def _in_out(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    return module.weight.shape[0], module.weight.shape[1]  # Conv1D: [in, out]


def choose_plan(model: nn.Module, injection_policy: Mapping | None = None,
                policy: "Policy | None" = None) -> ShardingPlan:
    """The plan to apply, from the first source that has one (see the module docstring)."""
    if injection_policy:
        return plan_from_injection_policy(model, injection_policy)
    hf, why_not = plan_from_hf(model)
    if hf is not None:
        return hf
    notes = [why_not] if why_not and hf_tp_plan(model) else []
    plan = plan_from_policy(policy) or heuristic_plan(model)
    if plan is None:
        raise ShardingError(
            f"nothing to shard in {type(model).__name__}: no injection_policy, "
            f"{why_not or 'no usable HF tp_plan'}, no shardwise policy for model_type "
            f"{getattr(getattr(model, 'config', None), 'model_type', None)!r}, and no "
            f"linear pairs the heuristic recognises; pass injection_policy="
            f"{{BlockClass: ('row.parallel.linear', ...)}}")
    plan.notes = notes + plan.notes
    return plan
