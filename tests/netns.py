"""Two "nodes" on this machine: two network namespaces joined by a virtual ethernet link.

``TwoNodes.create()`` makes namespaces ``<tag>a`` / ``<tag>b`` (``tag`` unique per call), a veth
pair with one end in each (``10.77.0.1/24`` in node 0, ``10.77.0.2/24`` in node 1), and brings
``lo`` and the link up in both. Each node sees only its own loopback and its end of the link, so
processes started with :meth:`TwoNodes.popen` talk to the other node only over the link, as two
hosts would. :meth:`TwoNodes.destroy` kills every process still inside the namespaces and
deletes them (the veth pair goes with them); it is safe to call twice.

``unavailable()`` says why namespaces cannot be made here (not root, ``ip`` missing, or the
kernel/container refusing ``ip netns add``), or None when they can.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from dataclasses import dataclass, field

#: node rank -> its address on the link (a /24 private to the two namespaces)
ADDRESSES = ("10.77.0.1", "10.77.0.2")
PREFIX_LEN = 24


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], text=True, capture_output=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why two network namespaces cannot be created here, or None when they can (probed by
    adding and deleting a throwaway namespace)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (ip netns add); run as root to exercise it"
    probe = f"swprobe{uuid.uuid4().hex[:8]}"
    added = _ip("netns", "add", probe, check=False)
    if added.returncode != 0:
        return f"`ip netns add` is refused here: {added.stderr.strip() or added.returncode}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class TwoNodes:
    """Two namespaces joined by a veth link; node ``r`` is ``names[r]`` at ``ADDRESSES[r]``."""

    tag: str
    names: tuple[str, str] = field(init=False)
    links: tuple[str, str] = field(init=False)  # each node's end of the veth pair
    _procs: list[subprocess.Popen] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.names = (f"{self.tag}a", f"{self.tag}b")
        self.links = (f"v{self.tag}a"[:15], f"v{self.tag}b"[:15])  # interface names: 15 chars

    @classmethod
    def create(cls) -> "TwoNodes":
        """Make both namespaces and the link between them (destroyed again if a step fails)."""
        nodes = cls(f"sw{uuid.uuid4().hex[:8]}")
        try:
            nodes._build()
        except BaseException:
            nodes.destroy()
            raise
        return nodes

    def _build(self) -> None:
        for ns in self.names:
            _ip("netns", "add", ns)
        _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for ns, link, addr in zip(self.names, self.links, ADDRESSES):
            _ip("link", "set", link, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/{PREFIX_LEN}", "dev", link)
            _ip("-n", ns, "link", "set", link, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def popen(self, node: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` inside node ``node``'s namespace in its own process group."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[node], *cmd],
                                start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def pids(self, node: int) -> list[int]:
        """Processes running inside node ``node``'s namespace."""
        out = _ip("netns", "pids", self.names[node], check=False).stdout
        return [int(p) for p in out.split()]

    def destroy(self) -> None:
        """Kill what this object started and anything left in the namespaces; delete them."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)
        for node, ns in enumerate(self.names):
            for pid in self.pids(node):  # only processes inside our own namespaces
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.links[0], check=False)  # if the move into a namespace failed
