"""``shardwise bench``: the measuring stick (filled in by the bench work)."""
