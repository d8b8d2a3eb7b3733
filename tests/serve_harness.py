"""Run an ASGI app (``shardwise.serve.api.build_app``) under uvicorn on 127.0.0.1 in a
background thread, for tests that talk to it with real HTTP clients (``openai``, ``httpx2``).

The listening socket is bound (port 0: a free port) and listening before uvicorn starts, so a
client can connect at once: connections wait in the backlog until the server accepts them, no
polling for readiness. Stopping is bounded: open streams get ``graceful_s`` to finish, the
thread ``join_s`` to end, else the test fails.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any, Iterator

import uvicorn
from openai import AsyncOpenAI, OpenAI


class ServerThread:
    """uvicorn serving ``app`` on ``127.0.0.1:port`` from a daemon thread."""

    def __init__(self, app: Any, graceful_s: float = 2.0, join_s: float = 15.0) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=graceful_s)
        self.server = uvicorn.Server(config)
        self.join_s = join_s
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "ServerThread":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(self.join_s)
        self.sock.close()
        assert not self.thread.is_alive(), f"uvicorn did not stop within {self.join_s} s"


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
