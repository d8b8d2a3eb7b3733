"""``shardwise conformance``: run the accelerator conformance suite against an installed plugin."""

from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser("conformance", help="run the accelerator conformance suite",
                       description="Run the accelerator conformance suite (the checks every "
                                   "accelerator plugin must pass) and print PASS/FAIL per check. "
                                   "Exits 1 when a check fails.")
    p.add_argument("name", nargs="?", default=None,
                   help="accelerator plugin to test (default: the one auto-detection picks)")
    return p


def format_results(name: str, results) -> str:
    """One ``PASS``/``FAIL`` line per check (with the failure message), then a summary line."""
    lines = []
    for result in results:
        if result.passed:
            skipped = result.message.startswith("skipped")
            lines.append(f"PASS  {result.name}" + (f" ({result.message})" if skipped else ""))
        else:
            lines.append(f"FAIL  {result.name}: {result.message}")
    passed = sum(r.passed for r in results)
    lines.append(f"{passed}/{len(results)} conformance checks passed for accelerator {name!r}")
    return "\n".join(lines)


def run(args) -> int:
    from ..testing import accelerator_under_test, run_conformance

    # unknown, broken or unavailable: a ShardwiseError, which main() reports with exit code 2
    accelerator = accelerator_under_test(args.name)
    results = run_conformance(accelerator)
    print(format_results(accelerator.name, results))
    return 0 if all(r.passed for r in results) else 1
