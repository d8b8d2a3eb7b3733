"""``shardwise serve``: an OpenAI-compatible HTTP server with continuous batching over one
engine (see :mod:`shardwise.serve.types` for how its layers fit together).

Modules: ``types`` (the shared contract), ``api`` / ``protocol`` / ``embeddings`` (HTTP and
OpenAI bodies), ``detok`` / ``sampling`` (text and token choice), ``scheduler`` / ``metrics``
(continuous batching, Prometheus), ``runner`` (the slots of the engine's KV cache; tensor
parallel steps), ``server`` (``build_stack``, ``serve``: the process) and ``rank_main`` (one rank
of ``--tp N``). Nothing heavy is imported here: ``shardwise serve --help`` stays fast.
"""
