"""Built-in accelerator plugins (``cpu``, ``cuda``, ``hpu``).

They register through the ``shardwise.accelerators`` entry-point group exactly like a third-party
plugin; nothing here imports a device runtime at import time.
"""
