"""Kernel implementations by backend.

``reference`` holds the pure-torch oracle of every op; ``triton`` and ``cpu`` are backends
registered through the ``shardwise.kernels`` entry-point group. Every backend keeps one module per
op family, named alike (``rotary``, ``activations``, ``attention``, ``kv_cache``, ``norms``,
``quant``), each with ``register(registry)``; a backend's ``FAMILIES`` lists them. Nothing here is
imported, let alone compiled, until an op is first resolved (see ``shardwise.kernel_registry``).
"""
