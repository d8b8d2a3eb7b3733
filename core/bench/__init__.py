"""``shardwise bench``: the measuring stick.

Modules, each small and usable alone:

* :mod:`.plan` — what to run (models × cells × variants), validated before heavy work;
* :mod:`.presets` — built-in model shapes with fixed-seed random weights;
* :mod:`.runner` — timing generate for each variant in this process, failures captured per row;
* :mod:`.launch` / :mod:`.worker` — ``--tp N`` through ``torch.distributed.run``;
* :mod:`.stats`, :mod:`.roofline`, :mod:`.figures` — the arithmetic (pure functions);
* :mod:`.report`, :mod:`.chart`, :mod:`.compare` — JSON, table, PNG and ``--compare``;
* :mod:`.session` — one run end to end (:func:`run_bench`).

Nothing heavy is imported here: ``python -m shardwise.bench.worker`` and the CLI import what
they use.
"""
