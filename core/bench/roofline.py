"""Roofline figures: what fraction of the device's memory bandwidth decode achieves, and the
arithmetic rate of prefill.

Decode of a small batch is bound by reading the weights: every step reads each weight once, so

    decode GB/s = weight bytes / median step time / 1e9
    % of bandwidth = 100 × decode GB/s / measured device GB/s

Prefill is bound by compute: a token costs about two FLOPs (a multiply and an add) per
non-embedding parameter, so

    prefill TFLOP/s ≈ 2 × non-embedding parameters × prompt tokens × batch / prefill time / 1e12

(attention's own FLOPs, quadratic in the prompt, are left out; for short prompts they are small).
For an MoE model a token multiplies the dense parameters and its top-k experts only, so the
parameters counted are the *active* ones (:func:`active_parameters`: dense plus top_k /
num_experts of the experts held, per rank under expert parallelism).

A decode step does not read every weight. An input embedding table (token or position) that is
not also the output head is only looked up: a step reads one row per token, not the table
(:func:`unread_embedding_bytes`; a tied table is read whole by the head). A
Mixture-of-Experts decode step also reads, in each MoE layer, only the experts its tokens were
routed to, besides the dense parts (attention, norms, router, shared experts, embeddings as for a
dense model). Its GB/s counts those bytes
(:func:`moe_decode_bytes`): the experts are *counted* by a hook on each experts module during
the timed decode steps (:class:`RoutingCounter`, method ``"measured"``); where no hook fired
(an engine that no longer calls the experts module) the count is the expected number of
distinct experts for uniform routing (method ``"expected"``, :func:`expected_distinct_experts`).

The device's bandwidth is measured here, on the device, by copying a large tensor:
read + write = 2 × size bytes per copy, before and after the timed runs (the higher is used:
see :class:`Bandwidth`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from ..accelerator import Accelerator
from .stats import median

MiB = 1 << 20
#: :func:`moe_decode_bytes`' method for a dense model (records before 2026-11-26 say "all
#: weights": they counted every input embedding table whole).
READ_WEIGHTS = "weights read (input embeddings: the rows looked up)"
#: Both are far above any cache (a GPU's L2 is ~50–130 MB).


# ----- arithmetic (pure) --------------------------------------------------------------------------

def copy_gbps(nbytes: int, seconds: float) -> float:
    """GB/s of copying ``nbytes`` in ``seconds``: the copy reads and writes them (2 × nbytes)."""
    return 2 * nbytes / seconds / 1e9


def decode_gbps(weight_bytes: int, step_s: float) -> float:
    """GB/s of weights read by a decode step that reads ``weight_bytes`` in ``step_s``."""
    return weight_bytes / step_s / 1e9


def bandwidth_pct(achieved_gbps: float, device_gbps: float) -> float:
    """``achieved_gbps`` as a percentage of the device's measured ``device_gbps``."""
    return 100 * achieved_gbps / device_gbps


def prefill_tflops(nonembedding_params: int, prompt_len: int, batch: int,
                   prefill_s: float) -> float:
    """≈ 2 × non-embedding params × prompt tokens × batch / prefill seconds / 1e12."""
    return 2 * nonembedding_params * prompt_len * batch / prefill_s / 1e12


# ----- model facts ----------------------------------------------------------------------------------

def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters, each shared (tied) parameter once: what one decode step
    reads. Under tensor parallelism, call it on a rank's module to get that rank's bytes."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # quantized layers hold their weights as buffers (shardwise.quant.QuantLinear)
    return params + sum(b.numel() * b.element_size() for m in model.modules()
                        if getattr(m, "counts_buffers_as_weights", False)
                        for b in m.buffers(recurse=False))


def embedding_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of embedding tables (token and position) and of the output embeddings."""
    params = [p for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()]
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None:
        params.extend(output.parameters())
    return params


def nonembedding_parameters(model: nn.Module) -> int:
    """Parameters minus those of :func:`embedding_parameters` (each counted once): the ones a
    prompt token multiplies (generate computes the output head for the last token only)."""
    embedding_ids = {id(p) for p in embedding_parameters(model)}
    return sum(p.numel() for p in model.parameters() if id(p) not in embedding_ids) + sum(
        quantized_weight_count(m) for m in model.modules()  # quantized layers' weights
        if getattr(m, "counts_buffers_as_weights", False) and m is not _output(model))


def quantized_weight_count(module: nn.Module) -> int:
    """Weights a quantized module holds as buffers, counted as the parameters they replace:
    ``in × out`` of a linear; ``experts × 3 × hidden × intermediate`` of quantized experts
    (gate, up and down per expert)."""
    if hasattr(module, "in_features"):
        return module.in_features * module.out_features
    return module.num_experts * 3 * module.hidden_dim * module.intermediate_dim


def active_parameters(model: nn.Module) -> int:
    """:func:`nonembedding_parameters` a prompt token multiplies on average: for an MoE model
    the dense ones plus ``top_k / num_experts`` of the experts held here (a token computes
    ``top_k`` experts of ``num_experts``; a rank holding some of them computes that share of
    its own); every one for a dense model."""
    modules = expert_modules(model)
    top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    total = nonembedding_parameters(model)
    if not modules or not top_k:
        return total
    experts = sum(expert_parameters(m) for m in modules)
    share = top_k / (model_expert_count(model) or modules[0].num_experts)
    return round(total - experts + share * experts)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding stacked expert weights: an integer ``num_experts`` and either
    parameters of their own that all lead with one expert dimension of at most ``num_experts``
    entries, at least one of them 3-D ``(experts, out, in)`` (HF's ``MixtralExperts``,
    ``Qwen2MoeExperts``, GPT-OSS's with its 2-D expert biases, ...; under expert parallelism a
    rank's module holds only its own experts: :func:`local_experts`), or quantized weights as
    buffers (``counts_buffers_as_weights``: :class:`shardwise.quant.QuantExperts`, whose
    ``num_experts`` is what it holds). Shared experts are plain MLPs and stay dense."""
    found = []
    for module in model.modules():
        experts = getattr(module, "num_experts", None)
        if not isinstance(experts, int) or experts < 1:
            continue
        if getattr(module, "counts_buffers_as_weights", False):
            found.append(module)
            continue
        params = list(module.parameters(recurse=False))
        leading = {p.shape[0] if p.dim() >= 2 else None for p in params}
        if params and len(leading) == 1 and None not in leading and leading.pop() <= experts \
                and any(p.dim() == 3 for p in params):
            found.append(module)
    return found


def local_experts(module: nn.Module) -> int:
    """Experts an experts module holds on this rank: the leading dimension of its weights
    (``num_experts`` without expert parallelism, and for quantized experts)."""
    if getattr(module, "counts_buffers_as_weights", False):
        return module.num_experts
    return next(module.parameters(recurse=False)).shape[0]


def expert_bytes(module: nn.Module) -> int:
    """Bytes of the experts one experts module holds, quantized buffers included (one expert
    is this ÷ :func:`local_experts`)."""
    total = sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    if getattr(module, "counts_buffers_as_weights", False):
        total += sum(b.numel() * b.element_size() for b in module.buffers(recurse=False))
    return total


def expert_parameters(module: nn.Module) -> int:
    """Parameters of the experts one experts module holds (quantized ones counted as the
    weights they replace)."""
    own = sum(p.numel() for p in module.parameters(recurse=False))
    if getattr(module, "counts_buffers_as_weights", False):
        own += quantized_weight_count(module)
    return own


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int,
                              held: int | None = None) -> float:
    """Expected distinct experts, of the ``held`` ones a rank holds (default: all
    ``num_experts``), that ``tokens`` tokens pick when each picks ``top_k`` of ``num_experts``
    uniformly: ``held × (1 − (1 − k/E)^T)`` (``top_k`` at one token when a rank holds all)."""
    held = num_experts if held is None else held
    return held * (1 - (1 - top_k / num_experts) ** tokens)


class RoutingCounter:
    """Counts the distinct experts each experts module is asked for in decode steps.

    ``with RoutingCounter(model) as counter:`` hooks every :func:`expert_modules` module, and
    ``counter.next_generate()`` before each ``generate`` marks where one starts: a module's
    first call in a ``generate`` is its prefill (not counted), every later call a decode step.
    The hook keeps only the routing tensor (``top_k_index``, ``(rows, top_k)``: the second
    argument of HF's experts forward and of the experts-module contract,
    :mod:`shardwise.moe.spec`; no work, no device sync inside the timed steps); the distinct
    expert ids are counted afterwards, only those of experts the module holds (ids <
    :func:`local_experts`: under expert parallelism the ids are local and the value
    ``E_local`` marks an expert on another rank; in HF's own modules ids ≥ ``num_experts`` are
    padding). Rows are whatever the module computed: under the all-to-all dispatch, the tokens
    of every rank routed here. Steps a captured graph runs without calling the module fire
    no hook, so they are not counted."""

    def __init__(self, model: nn.Module):
        self.modules = expert_modules(model)
        self.routings: list[list[torch.Tensor]] = [[] for _ in self.modules]  # per module
        self._handles: list = []
        self._prefill_pending: set[int] = set()

    def __enter__(self) -> "RoutingCounter":
        for i, module in enumerate(self.modules):
            self._handles.append(module.register_forward_pre_hook(self._hook(i),
                                                                  with_kwargs=True))
        self.next_generate()
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def next_generate(self) -> None:
        """A ``generate`` starts: each module's next call is its prefill."""
        self._prefill_pending = set(range(len(self.modules)))

    def _hook(self, i: int):
        def keep(_module, args, kwargs):
            if i in self._prefill_pending:
                self._prefill_pending.discard(i)
                return
            index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if isinstance(index, torch.Tensor) and index.dim() == 2:
                self.routings[i].append(index)
        return keep

    @property
    def measured(self) -> bool:
        """Whether every experts module was seen in at least one decode step."""
        return bool(self.modules) and all(self.routings)

    def mean_distinct(self) -> list[float]:
        """Mean distinct experts (of those it holds) per decode step, per experts module."""
        return [sum(int((torch.unique(index) < local_experts(module)).sum()) for index in seen)
                / len(seen) for module, seen in zip(self.modules, self.routings)]


def model_expert_count(model: nn.Module) -> int | None:
    """The model's routed experts per MoE layer from its config (all ranks together)."""
    config = getattr(model, "config", None)
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def moe_decode_bytes(model: nn.Module, counter: RoutingCounter | None = None,
                     tokens: int = 1) -> tuple[int, str]:
    """``(bytes one decode step of ``tokens`` rows reads, method)``: for a dense model every
    weight less :func:`unread_embedding_bytes` (:data:`READ_WEIGHTS`); for an MoE model those
    bytes minus the experts modules' plus, per
    experts module, (distinct experts per step) × (one expert's bytes), counted by ``counter``
    (``"dense + routed experts (measured)"``) or, without a count, expected for uniform routing
    of ``tokens`` tokens over the config's ``num_experts_per_tok`` (``"... (expected)"``).
    Under expert parallelism ``model`` is one rank's: its own dense shards and, of the experts
    routed to, only those it holds."""
    total = weight_bytes(model) - unread_embedding_bytes(model, tokens)
    modules = expert_modules(model)
    if not modules:
        return total, READ_WEIGHTS
    if counter is not None and counter.measured:
        distinct, method = counter.mean_distinct(), "measured"
    else:
        top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
        if not top_k:
            return total, READ_WEIGHTS
        distinct = [expected_distinct_experts(model_expert_count(model) or m.num_experts, top_k,
                                              tokens, local_experts(m)) for m in modules]
        method = "expected"
    routed = sum(d * expert_bytes(m) / local_experts(m) for d, m in zip(distinct, modules))
    dense = total - sum(expert_bytes(m) for m in modules)
    return round(dense + routed), f"dense + routed experts ({method})"


def unread_embedding_bytes(model: nn.Module, tokens: int) -> int:
    """Bytes of the input embedding tables (``nn.Embedding``: token, position) a decode step of
    ``tokens`` rows leaves unread: all but ``tokens`` rows of each table that is not the output
    head's weight (a tied table is read whole by the head)."""
    output = _output(model)
    head = {id(p) for p in output.parameters()} if output is not None else set()
    unread, seen = 0, set(head)  # a table shared by two modules counted once, as weight_bytes
    for m in model.modules():
        if isinstance(m, nn.Embedding) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            n, dim = m.weight.shape
            unread += (n - min(tokens, n)) * dim * m.weight.element_size()
    return unread


def _output(model: nn.Module):
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


# ----- measuring the device --------------------------------------------------------------------------

@dataclass
class Bandwidth:
    """A measured device bandwidth: buffer size and the copy times of one or more probes.

    On a shared machine the bandwidth moves during a run, a lot and within minutes
    (benchmarks/README.md, "Reading these on a shared VM"), so a run probes
    before and after its variants and
    :attr:`gbps` is the highest probe's median: percentages of it are never flattered by a
    probe that happened to run while the machine was slow."""

    nbytes: int
    probes: list[list[float]] = field(default_factory=list)  # each probe's copy times

    @property
    def samples_s(self) -> list[float]:
        """Every probe's copy times, in order."""
        return [t for probe in self.probes for t in probe]

    @property
    def probe_gbps(self) -> list[float]:
        """GB/s of each probe's median copy (read + write)."""
        return [copy_gbps(self.nbytes, median(probe)) for probe in self.probes]

    @property
    def gbps(self) -> float:
        """The highest probe's GB/s (see the class docstring)."""
        return max(self.probe_gbps)

    def add(self, other: "Bandwidth") -> "Bandwidth":
        """This measurement with ``other``'s probes (same buffer size) appended."""
        if other.nbytes != self.nbytes:
            raise ValueError(f"bandwidth probes of {self.nbytes} and {other.nbytes} bytes")
        return Bandwidth(self.nbytes, self.probes + other.probes)

    def to_dict(self) -> dict:
        """Plain values for the JSON report."""
        return {"method": "copy", "bytes": self.nbytes, "bytes_moved_per_copy": 2 * self.nbytes,
                "samples_s": self.samples_s, "probes_gbps": self.probe_gbps,
                "gbps": self.gbps}


def probe_bytes(accelerator: Accelerator) -> int:
    """Default size of the bandwidth probe's buffer on ``accelerator``'s device, at most a
    quarter of its free memory."""
    wanted = accelerator.bandwidth_probe_bytes
    try:
        return max(MiB, min(wanted, accelerator.free_memory() // 4))
    except NotImplementedError:
        return wanted


def measure_bandwidth(accelerator: Accelerator, nbytes: int | None = None,
                      repeats: int = 5) -> Bandwidth:
    """Time ``repeats`` copies of an ``nbytes`` buffer on the device (after one warm-up copy),
    synchronizing through the accelerator around each."""
    nbytes = nbytes or probe_bytes(accelerator)
    device = accelerator.device()
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch of the pages, kernel selection
    samples = []
    for _ in range(repeats):
        accelerator.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        accelerator.synchronize()
        samples.append(time.perf_counter() - start)
    del src, dst
    return Bandwidth(nbytes // 4 * 4, [samples])
