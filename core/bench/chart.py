"""A PNG chart of a result document: the variants side by side for every cell.

Plotting is the optional ``plot`` extra (matplotlib; ``pip install -e '.[plot]'`` from a clone,
which the README's first command does); without matplotlib,
:func:`write_chart` returns None and the caller says how to get charts.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

#: How to get charts, from a clone or from an installed wheel alike (the plot extra's requirement).
PLOT_INSTALL = "pip install 'matplotlib>=3.7'"

#: (panel title, figure path, whisker path or None)
PANELS = (("decode latency, ms/token (median, p90 whisker)", ("decode_ms", "median"),
           ("decode_ms", "p90")),
          ("prefill latency, ms (median, p90 whisker)", ("prefill_ms", "median"),
           ("prefill_ms", "p90")),
          ("decode tokens/s", ("tokens_per_s",), None),
          ("decode weight bandwidth, % of measured", ("bandwidth_pct",), None))
#: Panels added for a run with offloading variants (``--offload``; empty for the other rows).
OFFLOAD_PANELS = (("offload: weights streamed per decode step, % of the tier's probe",
                   ("offload", "probe_pct"), None),
                  ("offload: read/compute overlap (1 = reads hidden)", ("offload", "overlap"),
                   None))


def plotting_available() -> bool:
    """True when matplotlib is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def _get(figures: dict, path: tuple[str, ...]) -> float | None:
    value = figures
    for key in path:
        value = (value or {}).get(key)
    return value


def _cells(runs: list[dict]) -> list[tuple]:
    seen: dict[tuple, None] = {}
    for r in runs:
        seen.setdefault((r["model"], r["batch"], r["prompt_len"], r["new_tokens"]), None)
    return list(seen)


def _variants(runs: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["variant"] for r in runs))


def _panel(ax, runs, cells, variants, title, path, whisker) -> None:
    width = 0.8 / max(1, len(variants))
    by_key = {(r["model"], r["batch"], r["prompt_len"], r["new_tokens"], r["variant"]): r
              for r in runs}
    for j, variant in enumerate(variants):
        for i, cell in enumerate(cells):
            rec = by_key.get((*cell, variant))
            x = i + (j - (len(variants) - 1) / 2) * width
            value = _get(rec.get("figures") or {}, path) if rec else None
            if value is None:
                if rec is not None and rec["status"] != "ok":
                    ax.text(x, 0.02, "failed", rotation=90, ha="center", va="bottom",
                            fontsize=8, color="crimson", transform=ax.get_xaxis_transform())
                continue
            top = _get(rec["figures"], whisker) if whisker else None
            err = [[0], [top - value]] if top is not None else None
            ax.bar(x, value, width, yerr=err, capsize=3, color=f"C{j}")
    ax.set_title(title, fontsize=10)
    ax.set_xlim(-0.5, len(cells) - 0.5)
    ax.set_xticks(range(len(cells)))
    ax.set_xticklabels([f"{m[-24:]}\nb{b} p{p} n{n}" for m, b, p, n in cells], fontsize=8,
                       rotation=30 if len(cells) > 3 else 0, ha="right" if len(cells) > 3 else "center")


def write_chart(doc: dict, path: str | os.PathLike) -> Path | None:
    """Draw ``doc``'s runs into a PNG at ``path``; None when matplotlib is not installed."""
    if not plotting_available():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, prov = doc["runs"], doc["provenance"]
    cells, variants = _cells(runs), _variants(runs)
    panels = PANELS + (OFFLOAD_PANELS if any(r.get("offload") for r in runs) else ())
    rows = (len(panels) + 1) // 2
    width = max(10.0, 2.4 * len(cells) * max(1, len(variants)) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(width, 4.25 * rows))
    axes = axes.ravel()
    for ax, (title, fig_path, whisker) in zip(axes, panels):
        _panel(ax, runs, cells, variants, title, fig_path, whisker)
    axes[0].legend(fontsize=8, handles=[plt.Rectangle((0, 0), 1, 1, color=f"C{j}")
                                        for j in range(len(variants))], labels=variants)
    fig.suptitle(f"shardwise bench on {prov['device']} ({prov['device_name']}), "
                 f"{prov['date']}; measured bandwidth {doc['bandwidth']['gbps']:.1f} GB/s",
                 fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
