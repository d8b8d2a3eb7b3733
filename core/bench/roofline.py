"""Roofline figures: what fraction of the device's memory bandwidth decode achieves, and the
arithmetic rate of prefill.

Decode of a small batch is bound by reading the weights: every step reads each weight once, so

    decode GB/s = weight bytes / median step time / 1e9
    % of bandwidth = 100 × decode GB/s / measured device GB/s

Prefill is bound by compute: a token costs about two FLOPs (a multiply and an add) per
non-embedding parameter, so

    prefill TFLOP/s ≈ 2 × non-embedding parameters × prompt tokens × batch / prefill time / 1e12

(attention's own FLOPs, quadratic in the prompt, are left out; for short prompts they are small).

A Mixture-of-Experts decode step does not read every weight: it reads the dense parts
(attention, norms, router, shared experts, embeddings as for a dense model) and, in each MoE
layer, only the experts its tokens were routed to. Its GB/s counts those bytes
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
        m.in_features * m.out_features for m in model.modules()  # quantized layers' weights
        if getattr(m, "counts_buffers_as_weights", False) and m is not _output(model))


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding stacked expert weights: an integer ``num_experts`` and parameters of
    their own that are all 3-D ``(num_experts, out, in)`` (HF's ``MixtralExperts``,
    ``Qwen2MoeExperts``, ...; shared experts are plain MLPs and stay dense)."""
    found = []
    for module in model.modules():
        experts = getattr(module, "num_experts", None)
        params = list(module.parameters(recurse=False))
        if isinstance(experts, int) and experts > 0 and params and all(
                p.dim() == 3 and p.shape[0] == experts for p in params):
            found.append(module)
    return found


def expert_bytes(module: nn.Module) -> int:
    """Bytes of all the experts of one experts module (one expert is this / ``num_experts``)."""
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))


def expected_distinct_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts ``tokens`` tokens pick when each picks ``top_k`` of
    ``num_experts`` uniformly: ``E × (1 − (1 − k/E)^T)`` (``top_k`` at one token)."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


class RoutingCounter:
    """Counts the distinct experts each experts module is asked for in decode steps.

    ``with RoutingCounter(model, tokens=batch):`` hooks every :func:`expert_modules` module;
    a call whose routing (``top_k_index``, ``(tokens, top_k)``: the second argument of HF's
    experts forward) has exactly ``tokens`` rows is a decode step. The hook only keeps the
    routing tensor (no work, no device sync inside the timed steps); the distinct expert ids
    are counted afterwards (ids ≥ ``num_experts``, HF's padding for experts held elsewhere,
    are not). Prefill calls (more rows) are not counted."""

    def __init__(self, model: nn.Module, tokens: int):
        self.tokens = tokens
        self.modules = expert_modules(model)
        self.routings: list[list[torch.Tensor]] = [[] for _ in self.modules]  # per module
        self._handles: list = []

    def __enter__(self) -> "RoutingCounter":
        for i, module in enumerate(self.modules):
            self._handles.append(module.register_forward_pre_hook(self._hook(i),
                                                                  with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, i: int):
        def keep(_module, args, kwargs):
            index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if isinstance(index, torch.Tensor) and index.dim() == 2 \
                    and index.shape[0] == self.tokens:
                self.routings[i].append(index)
        return keep

    @property
    def measured(self) -> bool:
        """Whether every experts module was seen in at least one decode step."""
        return bool(self.modules) and all(self.routings)

    def mean_distinct(self) -> list[float]:
        """Mean distinct experts per decode step, per experts module."""
        return [sum(int((torch.unique(index) < module.num_experts).sum()) for index in seen)
                / len(seen) for module, seen in zip(self.modules, self.routings)]


def moe_decode_bytes(model: nn.Module, counter: RoutingCounter | None = None,
                     tokens: int = 1) -> tuple[int, str]:
    """``(bytes one decode step reads, method)``: every weight for a dense model
    (``"all weights"``); for an MoE model the weights minus the experts modules' plus, per
    experts module, (distinct experts per step) × (one expert's bytes), counted by ``counter``
    (``"dense + routed experts (measured)"``) or, without a count, expected for uniform routing
    of ``tokens`` tokens over the config's ``num_experts_per_tok`` (``"... (expected)"``)."""
    total = weight_bytes(model)
    modules = expert_modules(model)
    if not modules:
        return total, "all weights"
    if counter is not None and counter.measured:
        distinct, method = counter.mean_distinct(), "measured"
    else:
        top_k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
        if not top_k:
            return total, "all weights"
        distinct = [expected_distinct_experts(m.num_experts, top_k, tokens) for m in modules]
        method = "expected"
    routed = sum(d * expert_bytes(m) / m.num_experts for d, m in zip(distinct, modules))
    dense = total - sum(expert_bytes(m) for m in modules)
    return round(dense + routed), f"dense + routed experts ({method})"


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
