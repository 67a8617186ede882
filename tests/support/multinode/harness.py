"""N simulated nodes on one machine: namespaces, a switch, real `kvd serve` on each.

Each node is a network namespace (``ip netns``) entered by a process that also takes
its own mount namespace (a private tmpfs on /dev/shm), IPC, UTS and PID namespace:
`node_agent.py` runs there as PID 1, so everything it starts dies with it. The nodes
are wired to a switch: one bridge per rail in a namespace of its own, one veth pair
per node and rail. Addresses are 198.18.<rail>.<node + 1>/24, only ever inside these
namespaces (198.18.0.0/15 is the benchmarking range, never routed).

A partition is a port of the switch taken down (the node sees no carrier; TCP
connections stay ESTABLISHED and resume when it comes back, as across a real switch).
Byte counters of the switch ports show what crossed each link.

Everything is removed on every exit path: `Cluster.close` (context manager, also
registered with atexit), and namespaces left by a run that was killed are reaped at the
next start (their names carry the owner's pid). The performance issue's two-rail test
builds on ``rails=2``.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NS_PREFIX = "kvdmn"
AGENT = Path(__file__).resolve().parent / "node_agent.py"
SHM_SIZE = "2g"
TOKEN = "multinode-token-0123456789abcdef"
ENGINE_PORT, PEER_PORT, METRICS_PORT = 7100, 7101, 7102


def cannot_run() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if sys.platform != "linux":
        return "multi-node harness needs Linux namespaces"
    if os.geteuid() != 0:
        return "multi-node harness needs root (network namespaces, veth, mounts)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"multi-node harness needs `{tool}` on PATH"
    probe = f"{NS_PREFIX}-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


def reap_stale() -> None:
    """Delete namespaces of harness runs whose process is gone (a killed pytest)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        parts = name.split("-")
        if (len(parts) >= 3 and parts[0] == NS_PREFIX and parts[1].isdigit()
                and not Path(f"/proc/{parts[1]}").exists()):
            _ip("netns", "del", name, check=False)


class AgentError(RuntimeError):
    pass


@dataclass
class Node:
    index: int
    netns: str
    ips: list[str]  # one per rail
    proc: subprocess.Popen[str]

    @property
    def ip(self) -> str:
        return self.ips[0]

    @property
    def peer_address(self) -> str:
        return f"tcp://{self.ip}:{PEER_PORT}"

    def call(self, op: str, **kw: Any) -> Any:
        """Run one command in the node; raises AgentError with the node's traceback."""
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AgentError(f"node {self.index} agent died (rc {self.proc.poll()})")
        reply = json.loads(line)
        if "error" in reply:
            raise AgentError(f"node {self.index}: {reply['error']}")
        return reply["ok"]

    def start_daemon(self, name: str = "kvd", args: list[str] | None = None,
                     token: str = TOKEN, env: dict[str, str] | None = None,
                     engine_host: str = "127.0.0.1",
                     client_env: dict[str, str] | None = None) -> dict[str, Any]:
        """A `kvd serve` bound to this node's address, engines on its loopback (or on
        ``engine_host``; ``client_env``: what this node's engines read)."""
        return self.call("start_daemon", name=name, peer_address=self.peer_address,
                         token=token, engine_port=ENGINE_PORT, metrics_port=METRICS_PORT,
                         args=args or [], env=env, engine_host=engine_host,
                         client_env=client_env)


class Cluster:
    """``n`` nodes on ``rails`` switches; use as a context manager."""

    def __init__(self, n: int, log_dir: Path, rails: int = 1) -> None:
        self.n, self.rails, self.log_dir = n, rails, log_dir
        self.tag = f"{NS_PREFIX}-{os.getpid()}-{os.urandom(2).hex()}"
        self.switch = f"{self.tag}-sw"
        self.nodes: list[Node] = []
        self._netns: list[str] = []
        self._logs: list[Any] = []
        self._closed = False

    def __enter__(self) -> Cluster:
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def port_name(self, node: int, rail: int = 0) -> str:
        """The node's port on the switch (in namespace ``self.switch``)."""
        return self._port(node, rail)

    def _port(self, node: int, rail: int) -> str:
        return f"mn{self.tag[-4:]}n{node}r{rail}"[:15]

    def _build(self) -> None:
        reap_stale()
        self._add_netns(self.switch)
        for rail in range(self.rails):
            _ip("-n", self.switch, "link", "add", f"br{rail}", "type", "bridge")
            _ip("-n", self.switch, "link", "set", f"br{rail}", "up")
        for i in range(self.n):
            ns = f"{self.tag}-n{i}"
            self._add_netns(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            ips = []
            for rail in range(self.rails):
                port, ip = self._port(i, rail), f"198.18.{rail}.{i + 1}"
                inner = f"{port}x"  # unique on the host until it moves into the node
                _ip("link", "add", port, "type", "veth", "peer", "name", inner)
                _ip("link", "set", port, "netns", self.switch)
                _ip("link", "set", inner, "netns", ns)
                _ip("-n", ns, "link", "set", inner, "name", f"eth{rail}")
                _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", f"eth{rail}")
                _ip("-n", ns, "link", "set", f"eth{rail}", "up")
                _ip("-n", self.switch, "link", "set", port, "master", f"br{rail}")
                _ip("-n", self.switch, "link", "set", port, "up")
                ips.append(ip)
            self.nodes.append(Node(i, ns, ips, self._spawn_agent(i, ns)))

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._netns.append(name)

    def _spawn_agent(self, i: int, ns: str) -> subprocess.Popen[str]:
        node_dir = self.log_dir / f"node{i}"
        node_dir.mkdir(parents=True, exist_ok=True)
        inner = (f"mount -t tmpfs -o size={SHM_SIZE} tmpfs /dev/shm && hostname node{i} && "
                 f"exec {sys.executable} {AGENT} {node_dir}")
        cmd = ["ip", "netns", "exec", ns, "unshare", "--mount", "--ipc", "--pid", "--uts",
               "--fork", "--kill-child", "--mount-proc", "--propagation", "private",
               "sh", "-c", inner]
        stderr = open(node_dir / "agent.log", "w")  # noqa: SIM115 - closed by close()
        self._logs.append(stderr)
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=stderr, text=True, bufsize=1,
                                # Every daemon inherits faulthandler: a crash in native code
                                # (UCX) leaves the Python stacks of every thread in its log.
                                env={**os.environ, "PYTHONUNBUFFERED": "1",
                                     "PYTHONFAULTHANDLER": "1"})

    # ------------------------------------------------------------ the links

    def cut(self, node: int, rail: int = 0) -> None:
        """Partition: the node's switch port goes down (its packets are dropped)."""
        _ip("-n", self.switch, "link", "set", self._port(node, rail), "down")

    def shape(self, node: int, rate_mbit: int, rail: int = 0) -> None:
        """Limit the rate towards the node (its switch port's egress) to ``rate_mbit``."""
        _ip("-n", self.switch, "link", "show", self._port(node, rail))
        res = subprocess.run(["tc", "-n", self.switch, "qdisc", "replace", "dev",
                              self._port(node, rail), "root", "tbf", "rate",
                              f"{rate_mbit}mbit", "burst", "64kb", "latency", "400ms"],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"tc: {res.stderr.strip()}")

    def heal(self, node: int, rail: int = 0) -> None:
        _ip("-n", self.switch, "link", "set", self._port(node, rail), "up")

    def link_bytes(self, node: int, rail: int = 0) -> int:
        """Bytes through the node's switch port, both directions."""
        out = _ip("-n", self.switch, "-j", "-s", "link", "show", "dev", self._port(node, rail))
        stats = json.loads(out.stdout)[0]["stats64"]
        return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])

    # ------------------------------------------------------------ teardown

    def close(self) -> None:
        """Stop every node (daemons first, politely), then delete every namespace."""
        if self._closed:
            return
        self._closed = True
        for node in self.nodes:
            if node.proc.poll() is None:
                try:
                    node.call("stop_all")
                except Exception:  # noqa: BLE001 - tearing down regardless
                    pass
        deadline = time.monotonic() + 10
        for node in self.nodes:
            try:
                node.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.proc.kill()  # --kill-child: PID 1 of the node goes, and all in it
                node.proc.wait(5)
        for ns in reversed(self._netns):
            _ip("netns", "del", ns, check=False)
        self._netns.clear()
        for f in self._logs:
            f.close()
        atexit.unregister(self.close)
