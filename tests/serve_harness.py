"""Run an ASGI app (``shardwise.serve.api.build_app``) under uvicorn on 127.0.0.1 in a
background thread (:class:`shardwise.serve.server.ServerThread`), for tests that talk to it with
real HTTP clients (``openai``, ``httpx2``): the socket listens before uvicorn starts, so no
polling for readiness; stopping is bounded (else the test fails).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from openai import AsyncOpenAI, OpenAI

from shardwise.serve.server import ServerThread


@contextlib.contextmanager
def serving(app: Any, **kwargs: Any) -> Iterator[ServerThread]:
    """``with serving(app) as server:`` → a started :class:`ServerThread`, stopped after."""
    server = ServerThread(app, **kwargs).start()
    try:
        yield server
    finally:
        server.stop()


def openai_client(server: ServerThread, timeout: float = 60.0) -> OpenAI:
    """The real ``openai`` client pointed at ``server`` (no retries: tests see every status)."""
    return OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=timeout)


def async_openai_client(server: ServerThread, timeout: float = 60.0) -> AsyncOpenAI:
    """The ``openai`` asyncio client pointed at ``server`` (no retries)."""
    return AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                       timeout=timeout)
