"""Run kvd daemons as separate local processes (demo, benchmark, integration tests)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvd.client import KvdClient
from kvd.errors import KvdError

BIND_RETRIES = 3


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now: each picked while the ones before it are still
    held (two picks one after the other may return the same port)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        return ports


@dataclass
class DaemonProcess:
    name: str
    engine_address: str
    peer_address: str
    metrics_port: int
    proc: subprocess.Popen
    log_path: Path
    extra_args: list[str] = field(default_factory=list)
    token: str = ""

    @classmethod
    def start(cls, name: str, log_dir: Path, extra_args: list[str] | None = None,
              env: dict[str, str] | None = None, metrics: bool = True,
              timeout_s: float = 30.0, token: str = "", engine_address: str = "",
              peer_address: str = "") -> DaemonProcess:
        """Start and wait until it answers; ports this picks are retried if another
        process took one between the pick and the daemon's bind (free_port races)."""
        for attempt in range(BIND_RETRIES):
            e_port, p_port, m_port = free_ports(3)
            engine = engine_address or f"tcp://127.0.0.1:{e_port}"
            peer = peer_address or f"tcp://127.0.0.1:{p_port}"
            mport = m_port if metrics else 0
            d = cls._spawn(name, log_dir, extra_args, env, engine, peer, mport, token)
            try:
                d.wait_ready(timeout_s)
                return d
            except KvdError:
                # ZMQ's words, or kvd's own line for a face it could not bind
                lost_race = (d.proc.poll() is not None
                             and "address already in use" in d.log_path.read_text().lower())
                d.kill()  # not ready in time: never leave a daemon the caller cannot stop
                if not lost_race or attempt == BIND_RETRIES - 1:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _spawn(cls, name: str, log_dir: Path, extra_args: list[str] | None,
               env: dict[str, str] | None, engine: str, peer: str, mport: int,
               token: str) -> DaemonProcess:
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        args = [sys.executable, "-m", "kvd", "serve", "--engine-address", engine,
                "--peer-address", peer, "--metrics-port", str(mport),
                "--set", f"shm_prefix=kvd-{name}",
                # Local clusters stop quickly; later --set flags (extra_args) override this.
                "--set", "drain_timeout_s=2", *(extra_args or [])]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})}, start_new_session=True)
        return cls(name, engine, peer, mport, proc, log_path, list(extra_args or []), token)

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise KvdError(f"daemon {self.name} exited with {self.proc.returncode}:\n"
                               f"{self.log_path.read_text()[-2000:]}")
            try:
                with KvdClient(self.engine_address, timeout_s=0.5, ping_interval_s=0,
                               token=self.token) as c:
                    c.status()
                return
            except KvdError:
                time.sleep(0.1)
        raise KvdError(f"daemon {self.name} not ready after {timeout_s}s:\n"
                       f"{self.log_path.read_text()[-2000:]}")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the scraped samples of ``name`` whose labels include ``labels``."""
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
        return sum(s.value for fam in text_string_to_metric_families(text)
                   for s in fam.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def client(self, **kw: object) -> KvdClient:
        kw.setdefault("token", self.token)
        return KvdClient(self.engine_address, **kw)  # type: ignore[arg-type]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)
