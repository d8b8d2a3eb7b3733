"""``shardwise serve``: an OpenAI-compatible HTTP server with continuous batching over one
engine (see :mod:`shardwise.serve.types` for how its layers fit together)."""
