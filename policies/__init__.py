"""Injection policies, one module per model family, registered in the ``shardwise.policies``
entry-point group. (Kernel injection lands with the policies; this package is its home.)"""
