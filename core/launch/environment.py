"""What each rank's environment gets from the accelerator, and the rule for variables you set.

The accelerator's :meth:`~shardwise.Accelerator.launch_env` names the variables a rank needs
(``OMP_NUM_THREADS`` on the CPU, ``CUDA_VISIBLE_DEVICES`` on CUDA, ...). The rule, applied in
every rank before its script runs:

* a variable you set in the environment you ran ``shardwise launch`` from keeps your value in
  every rank (``OMP_NUM_THREADS=4 shardwise launch ...`` gives every rank 4 threads);
* except the accelerator's visible-devices variable (``visible_devices_env``): your list says
  which devices the node may use and each rank is narrowed to its own entry of it (rank 1 of
  ``CUDA_VISIBLE_DEVICES=2,3`` sees ``3``);
* every other variable the accelerator asks for is set to the accelerator's value.

The launcher records which variables were yours in :data:`USER_ENV_MARKER` before torch's
launcher adds its own defaults (it sets ``OMP_NUM_THREADS=1`` for several ranks), so a rank can
tell your values from torch's.
"""

from __future__ import annotations

import os
from typing import Mapping

from ..accelerator import Accelerator

#: Names of the launch variables you set yourself, comma-separated (written by the launcher).
USER_ENV_MARKER = "SHARDWISE_LAUNCH_USER_ENV"
#: The thread-count variable; torch reads it only at start-up, so ranks also set torch's count.
THREADS_ENV = "OMP_NUM_THREADS"


def launch_names(accelerator: Accelerator, local_world_size: int) -> set[str]:
    """Every variable the accelerator sets for some local rank of a node of this size."""
    names: set[str] = set()
    for local_rank in range(local_world_size):
        names |= accelerator.launch_env(local_rank, local_world_size).keys()
    return names


def user_set_names(accelerator: Accelerator, local_world_size: int,
                   environ: Mapping[str, str]) -> list[str]:
    """The accelerator's launch variables already present in ``environ`` (i.e. yours)."""
    return sorted(n for n in launch_names(accelerator, local_world_size) if n in environ)


def read_user_set(environ: Mapping[str, str]) -> set[str] | None:
    """The names the launcher recorded as yours; None when no shardwise launcher recorded them."""
    if USER_ENV_MARKER not in environ:
        return None
    return {n for n in environ[USER_ENV_MARKER].split(",") if n}


def rank_environment(accelerator: Accelerator, local_rank: int, local_world_size: int,
                     user_set: set[str]) -> dict[str, str]:
    """The variables to set for ``local_rank`` under the rule above (yours are left out, except
    the visible-devices variable, which is narrowed to this rank's entry of your list)."""
    env = accelerator.launch_env(local_rank, local_world_size)
    keep = user_set - {accelerator.visible_devices_env}
    return {k: v for k, v in env.items() if k not in keep}


def uniform_environment(accelerator: Accelerator, local_world_size: int,
                        user_set: set[str]) -> dict[str, str]:
    """The settings that are the same for every local rank (the launcher sets these in its own
    environment, so torch's launcher does not replace them with its defaults)."""
    per_rank = [rank_environment(accelerator, r, local_world_size, user_set)
                for r in range(local_world_size)]
    return {k: v for k, v in per_rank[0].items() if all(e.get(k) == v for e in per_rank)}


def torch_threads(environ: Mapping[str, str]) -> int | None:
    """The thread count ``$OMP_NUM_THREADS`` asks for, or None when unset or not a positive int."""
    try:
        threads = int(environ.get(THREADS_ENV, ""))
    except ValueError:
        return None
    return threads if threads > 0 else None


def _settings_text(settings: dict[str, str], user_set: set[str],
                   environ: Mapping[str, str]) -> str:
    """``A=1, B=2 (yours)`` plus the torch thread count those settings give."""
    words = [f"{k}={v}" for k, v in sorted(settings.items())]
    words += [f"{k}={environ[k]} (yours)" for k in sorted(user_set)
              if k in environ and k not in settings]
    final = {**environ, **settings}
    threads = torch_threads(final)
    if threads is not None:
        words.append(f"{threads} torch thread{'s' if threads > 1 else ''}")
    return ", ".join(words) or "no settings"


def describe_ranks(accelerator: Accelerator, world_size: int, local_world_size: int,
                   user_set: set[str], environ: Mapping[str, str] | None = None) -> str:
    """One line saying what each rank of this node got, e.g. ``2 ranks on cpu (2 per node x 1
    node); each rank: OMP_NUM_THREADS=1, 1 torch thread``."""
    environ = os.environ if environ is None else environ
    nodes = max(1, world_size // max(1, local_world_size))
    head = (f"shardwise launch: {world_size} rank{'s' if world_size > 1 else ''} on "
            f"{accelerator.name} ({local_world_size} per node x {nodes} node"
            f"{'s' if nodes > 1 else ''})")
    texts = [_settings_text(rank_environment(accelerator, r, local_world_size, user_set),
                            user_set, environ) for r in range(local_world_size)]
    if len(set(texts)) == 1:
        return f"{head}; each rank: {texts[0]}"
    return f"{head}; " + "; ".join(f"local rank {r}: {t}" for r, t in enumerate(texts))
