"""``shardwise accelerators``: the installed accelerator plugins and whether each can run."""

from __future__ import annotations

import json

from ..plugins import describe_accelerators

COLUMNS = ("name", "package", "available", "devices", "backend", "dtypes", "kernel_backends")


def add_parser(sub):
    p = sub.add_parser("accelerators", help="list installed accelerator plugins",
                       description="List installed accelerator plugins: availability (or the "
                                   "reason not), devices, backend, dtypes, kernel backends, "
                                   "load errors, and entry points ignored because another "
                                   "plugin has the same name.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def format_table(rows: list[dict]) -> str:
    """Render plugin rows as an aligned text table; reasons, notes and ignored duplicate entry
    points of the same name on indented lines."""
    cells = [[("yes" if r[c] else "no") if c == "available" else str(r[c]) for c in COLUMNS]
             for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)).rstrip()]
    for row, r in zip(cells, rows):
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
        if r["reason"]:
            lines.append(f"    reason: {r['reason']}")
        if r["notes"]:
            lines.append(f"    notes: {r['notes']}")
        for note in r.get("duplicates", ()):
            lines.append(f"    duplicate: {note}")
    return "\n".join(lines)


def run(args) -> int:
    rows = describe_accelerators()
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0
