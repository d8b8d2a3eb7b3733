"""The CPU backend's native (C++) kernels, built at first use and cached per user.

:func:`load` builds ``quant.cpp``, ``attention.cpp``, ``half.cpp`` and ``elementwise.cpp`` (shipped
in this package)
with ``torch.utils.cpp_extension`` into torch's per-user extensions cache
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``; a later process reuses the
build, a changed source or torch rebuilds it) and returns whether the ops
``torch.ops.shardwise_native.cpu_qlinear``, ``cpu_blocked_linear``, ``cpu_attention_decode``,
``cpu_chunk_attention`` (the prompt chunks of a served mixed step) and
the layer's elementwise ops (``cpu_rms_norm``, ``cpu_add_rms_norm``, ``cpu_rotary``,
``cpu_silu_and_mul``; used inside compiled steps of wide enough layers, :func:`in_compiled_step`)
are usable.
The kernels split their work with ATen's ``parallel_for`` over torch's intra-op threads
(``torch.set_num_threads``), the library built with OpenMP against the runtime torch loaded.
It is compiled with explicit AVX512 flags (never ``-march=native``: the cache may outlive the CPU),
so it is only built where the CPU reports ``avx512f``, ``avx512bw``, ``avx512vl`` and
``avx512_vnni``. Anything that stops it (no such CPU, no compiler, a failed build, the opt-out
below) makes :func:`load` return False after one logged line, and the callers keep torch's
packed kernels and the Python decode-attention op.

Opt-out: ``SHARDWISE_CPU_QUANT_KERNEL=torch`` (``native``, the default, builds and uses it) for
the quantized linears and the 16-bit linears of CPU graphs (which then keep their plain layout
and the compiled row product); the decode attention uses the native op wherever it builds.
``SHARDWISE_CPU_ELEMENTWISE``: ``native`` (the default) has compiled steps call the native
elementwise ops for rows at least :data:`NATIVE_MIN_WIDTH` wide, ``always`` at every width,
``torch`` never (their torch forms traced, for inductor to fuse): the A/B of
``benchmarks/startup.py --elementwise``.
On a CPU with AVX512-BF16 the 16-bit op runs bf16 with ``vdpbf16ps`` or widened to fp32 with
FMAs (as on other CPUs), whichever its one-off timing in the process finds faster
(:func:`cpu_bf16_dot_choice`; the dot loops unless the widening ones are clearly faster);
``SHARDWISE_CPU_BF16_DOT=1`` forces the dot loops, ``=0`` the widening ones, to compare them.
Any other value of these variables is a :class:`~shardwise.errors.ConfigError`.
``SHARDWISE_CPU_NATIVE_CFLAGS`` adds compiler flags to the build (A/B builds of compile-time
constants, e.g. ``-DSHARDWISE_PREFETCH_BYTES=0``; a changed value rebuilds).

The ops' fake (meta) implementations are registered here, so each runs inside the
``torch.compile``'d decode step (CPU graphs) as one opaque call.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

from shardwise.errors import ConfigError

log = logging.getLogger(__name__)

#: Environment variable choosing the CPU quant_linear kernel: "native" (default) or "torch".
ENV = "SHARDWISE_CPU_QUANT_KERNEL"
CHOICES = ("native", "torch")
#: :data:`ELEMENTWISE_ENV`'s values
ELEMENTWISE_CHOICES = ("native", "always", "torch")
#: CPU flags (as /proc/cpuinfo spells them) the build's instruction set needs.
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
CFLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma",
          "-fopenmp", "-std=c++17"]
#: -fopenmp also at link time: the library then needs libgomp.so.1, the soname of the OpenMP
#: runtime torch already loaded, so its at::parallel_for regions share torch's one thread pool.
#: (Without -fopenmp ATen's parallel_for compiles to a serial loop: before 2026-11-27 every
#: native kernel ran on one thread whatever torch.set_num_threads said.)
LDFLAGS = ["-fopenmp"]
SOURCES = tuple(Path(__file__).with_name(f)
                for f in ("quant.cpp", "attention.cpp", "half.cpp", "elementwise.cpp"))
#: Environment variable choosing the elementwise ops of compiled steps: "native" (default),
#: "always" or "torch" (:func:`in_compiled_step`).
ELEMENTWISE_ENV = "SHARDWISE_CPU_ELEMENTWISE"
#: Environment variable forcing the bf16 loops of the 16-bit op: "1" dot, "0" widening (unset:
#: the op's own timing picks, :func:`cpu_bf16_dot_choice`).
BF16_DOT_ENV = "SHARDWISE_CPU_BF16_DOT"
#: Environment variable adding compiler flags to the build, for A/B builds of the kernels'
#: compile-time constants (e.g. ``-DSHARDWISE_PREFETCH_BYTES=0``, ``simd.h``); torch keys its
#: cached build on the flags too, so a changed value rebuilds.
EXTRA_CFLAGS_ENV = "SHARDWISE_CPU_NATIVE_CFLAGS"
#: Extension (and cache folder) name; bump when an op's schema changes or an op is added (or
#: when ``scratch.h`` or ``simd.h``, which the sources include, change: torch keys its cached
#: build on the sources).
NAME = "shardwise_cpu_native_v11"

#: What runs instead when the extension is not usable (the log line says it).
FALLBACK = ("int8/int4 use torch's packed kernels, 16-bit linears of CPU graphs the compiled row "
            "product")

_lock = threading.Lock()
_state: dict[str, bool] = {}
#: Whether the op is loaded in this process (set by :func:`load`; read by compiled code).
LOADED = False
#: Whether compiled steps call the native elementwise ops (set by :func:`load` from
#: :data:`ELEMENTWISE_ENV`; read by compiled code).
ELEMENTWISE = False
#: Whether they do so at every width (``always``), not only from :data:`NATIVE_MIN_WIDTH` on.
ELEMENTWISE_ALL = False


def choice(env: str = ENV) -> str:
    """The kernel ``env`` (:data:`ENV` or :data:`ELEMENTWISE_ENV`) asks for ("native" when
    unset); ConfigError for another value."""
    value = os.environ.get(env, "").strip().lower() or "native"
    choices = CHOICES if env == ENV else ELEMENTWISE_CHOICES
    if value not in choices:
        meaning = ("native: the C++ kernels; torch: torch's packed kernels" if env == ENV else
                   "native: the C++ ops for wide enough rows; always: at every width; torch: "
                   "their torch forms, fused by the compiler")
        raise ConfigError(f"{env}={value!r}: expected one of {', '.join(choices)} ({meaning})")
    return value


def check_bf16_dot_env() -> None:
    """ConfigError unless :data:`BF16_DOT_ENV` is unset, empty, "1" or "0" (the op itself reads
    any other value as unset: checked here, at :func:`load`, so it is never ignored silently)."""
    value = os.environ.get(BF16_DOT_ENV, "")
    if value not in ("", "0", "1"):
        raise ConfigError(f"{BF16_DOT_ENV}={value!r}: expected 1 (bf16 by vdpbf16ps), 0 (widened "
                          "to fp32, FMAs) or unset (the faster on this CPU, timed once)")


def missing_cpu_flags() -> list[str]:
    """The :data:`CPU_FLAGS` this CPU lacks (all of them where /proc/cpuinfo is unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return list(CPU_FLAGS)
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    return [f for f in CPU_FLAGS if f not in flags]


def cflags() -> list[str]:
    """The build's compiler flags: :data:`CFLAGS`, then :data:`EXTRA_CFLAGS_ENV`'s
    (whitespace-separated)."""
    return list(CFLAGS) + os.environ.get(EXTRA_CFLAGS_ENV, "").split()


def _build() -> None:
    """Compile (or reuse the cached build of) the extension and load it into torch."""
    from torch.utils import cpp_extension

    # copies: torch appends its libraries to the ldflags list it is given, and a changed list
    # makes a second load in the process build and dlopen another copy of the ops (abort)
    cpp_extension.load(name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=cflags(),
                       extra_ldflags=list(LDFLAGS), is_python_module=False, verbose=False)
    _register_fake()


def _register_fake() -> None:
    @torch.library.register_fake("shardwise_native::cpu_qlinear")
    def _(x, qweight, scales, zeros, bias, bits, group, ablock, n):
        return x.new_empty((x.shape[0], n))  # [M, N] in x.dtype, as the C++ op returns

    @torch.library.register_fake("shardwise_native::cpu_blocked_linear")
    def _(x, blocked, bias, n):
        return x.new_empty((x.shape[0], n))  # [M, N] in x.dtype

    @torch.library.register_fake("shardwise_native::cpu_attention_decode")
    def _(q, k_cache, v_cache, lengths, starts, alibi_slopes, scale, window, sinks):
        return q.new_empty(q.shape)  # contiguous [batch, q_heads, 1, d], as the C++ op returns

    @torch.library.register_fake("shardwise_native::cpu_chunk_attention")
    def _(q, k_cache, v_cache, spans, alibi_slopes, scale, window, sinks):
        return q.new_empty(q.shape)  # contiguous [1, q_heads, tokens, d]

    @torch.library.register_fake("shardwise_native::cpu_rms_norm")
    def _(x, weight, eps):
        return x.new_empty(x.shape)  # contiguous, x's dtype

    @torch.library.register_fake("shardwise_native::cpu_add_rms_norm")
    def _(x, residual, weight, eps):
        return x.new_empty(x.shape), x.new_empty(x.shape)  # (out, h)

    @torch.library.register_fake("shardwise_native::cpu_rotary")
    def _(q, k, cos, sin, interleaved):
        return q.new_empty(q.shape), k.new_empty(k.shape)  # contiguous [b, heads, s, d]

    @torch.library.register_fake("shardwise_native::cpu_silu_and_mul")
    def _(x, up):
        inter = x.shape[-1] if up is not None else x.shape[-1] // 2
        return x.new_empty((*x.shape[:-1], inter))


def load(respect_choice: bool = True) -> bool:
    """Whether the native op is usable here, building it on the first call (module docstring);
    later calls return the first answer. With ``respect_choice`` (for choosing a layout) the
    opt-out :data:`ENV` makes it False; without (to run a weight already in the native layout)
    the op is built whatever it says. Raises only for a bad :data:`ENV` value."""
    global LOADED, ELEMENTWISE, ELEMENTWISE_ALL
    if respect_choice and choice() != "native":
        return False
    if LOADED:
        return True
    with _lock:
        if "ok" not in _state:
            elementwise = choice(ELEMENTWISE_ENV)  # a bad value: raised before any build
            check_bf16_dot_env()
            _state["ok"] = LOADED = _try_build()
            ELEMENTWISE = LOADED and elementwise != "torch"
            ELEMENTWISE_ALL = elementwise == "always"
        return _state["ok"]


def _try_build() -> bool:
    missing = missing_cpu_flags()
    if missing:
        log.warning("shardwise: CPU native kernels off: %s (this CPU lacks %s for the native "
                    "kernels)", FALLBACK, ", ".join(missing))
        return False
    try:
        _build()
    except Exception as exc:  # no compiler, failed build or load: keep torch's kernels
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        log.warning("shardwise: CPU native kernels off: %s (building the native kernels failed: "
                    "%s: %s; set %s=torch to skip the attempt)", FALLBACK,
                    type(exc).__name__, first, ENV)
        return False
    return True


def cpu_qlinear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None, bias: torch.Tensor | None, bits: int, group: int,
                ablock: int, n: int) -> torch.Tensor:
    """``torch.ops.shardwise_native.cpu_qlinear`` (layout and math: ``quant.cpp``'s header);
    call only after :func:`load` returned True."""
    return torch.ops.shardwise_native.cpu_qlinear(x, qweight, scales, zeros, bias, bits, group,
                                                  ablock, n)


def cpu_bf16_dot_choice() -> tuple[bool, float, float]:
    """Which loops the 16-bit op runs bf16 with on this CPU: (True for ``vdpbf16ps``, the dot
    loops' and the widening loops' seconds in the op's one-off timing of 8 rows against a block
    of 32 x 1024 in cache; both 0.0 on a CPU without AVX512-BF16, where it always widens).
    Timed once per process, at the first call of this or of a bf16 linear; the environment's
    ``SHARDWISE_CPU_BF16_DOT`` (``1`` / ``0``) overrides the pick. Needs :func:`load`."""
    picks, dot_s, widen_s = torch.ops.shardwise_native.cpu_bf16_dot_choice()
    return bool(picks), dot_s, widen_s


def cpu_blocked_linear(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None,
                       n: int) -> torch.Tensor:
    """``torch.ops.shardwise_native.cpu_blocked_linear``: x [M, K] (in the weight's dtype, or
    fp32) times the 16-bit weight laid out in column blocks [Nb, K, 32] (``half.cpp``'s
    header), plus ``bias`` [n], → [M, n] in x's dtype (an fp32 x: nothing rounded, the weight
    widened exactly); call only after :func:`load` returned True."""
    return torch.ops.shardwise_native.cpu_blocked_linear(x, blocked, bias, n)


#: The narrowest row a compiled step hands to each native elementwise op (the hidden size for
#: rms_norm, q_heads x head_dim for rotary, the intermediate size for silu_and_mul). A native
#: call costs ~2 us more than the kernel inductor would fuse (four calls a layer), a measurable
#: share of a narrow layer's step (SmolLM2-135M, 576 / 576 / 1536, int8: ~6% per token) for a
#: smaller compile saving; at a 1.7B's widths (2048 / 2048 / 8192) the step is within noise and
#: the first start ~10 s shorter (benchmarks/README.md, "Start-up").
NATIVE_MIN_WIDTH = {"rms_norm": 1024, "rotary": 1024, "silu_and_mul": 2048}


def in_compiled_step(op: str, width: int) -> bool:
    """Whether ``op`` (a key of :data:`NATIVE_MIN_WIDTH`) on rows of ``width`` elements, in the
    code running now, is being traced into a compiled CPU step with the extension loaded and wide
    enough rows: there the CPU kernels call the native op (one opaque call instead of a fused
    kernel inductor generates and builds per layer). Eager code keeps torch's (measured)
    implementations; so do compiled steps with :data:`ELEMENTWISE_ENV` ``=torch`` (and with
    ``=always`` every width takes the native op).
    ``ELEMENTWISE`` is read as a constant by dynamo: the CPU graph strategy builds the extension
    before any capture, and steps are keyed by it (:func:`key_text`; the widths are the model's
    shapes, already in every step's key)."""
    wide = ELEMENTWISE_ALL or width >= NATIVE_MIN_WIDTH[op]
    return ELEMENTWISE and wide and torch.compiler.is_compiling()


def key_text() -> str:
    """What a compiled step that may call these ops depends on, for its cache key: whether the
    extension is usable in this process (building it on the first call), so a step compiled with
    the native ops is never served to a process without them, nor the other way round; and
    whether its elementwise ops are the native ones (:data:`ELEMENTWISE_ENV`, and from which
    widths on)."""
    return (f"native={load(respect_choice=False)},quant={choice()},"
            f"elementwise={ELEMENTWISE},all={ELEMENTWISE_ALL}:{sorted(NATIVE_MIN_WIDTH.items())}")
