"""Kernel implementations by backend.

``reference`` holds the pure-torch oracle of every op; ``triton`` and ``cpu`` are backends
registered through the ``shardwise.kernels`` entry-point group. Nothing here is imported, let
alone compiled, until an op is first resolved (see ``shardwise.kernel_registry``).
"""
