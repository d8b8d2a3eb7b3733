"""Roofline figures: what fraction of the device's memory bandwidth decode achieves, and the
arithmetic rate of prefill.

Decode of a small batch is bound by reading the weights: every step reads each weight once, so

    decode GB/s = weight bytes / median step time / 1e9
    % of bandwidth = 100 × decode GB/s / measured device GB/s

Prefill is bound by compute: a token costs about two FLOPs (a multiply and an add) per
non-embedding parameter, so

    prefill TFLOP/s ≈ 2 × non-embedding parameters × prompt tokens × batch / prefill time / 1e12

(attention's own FLOPs, quadratic in the prompt, are left out; for short prompts they are small).

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
