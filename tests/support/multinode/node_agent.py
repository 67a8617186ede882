"""One simulated node's hands: runs inside the node's namespaces, driven over a pipe.

`harness.Node` starts this script as PID 1 of the node's PID namespace, after a private
tmpfs is mounted on /dev/shm, so the daemons it starts and the engines it plays share
that node's network, /dev/shm and IPC, and nothing of the other nodes'. It reads one
JSON command per line on stdin (``{"op": name, **kwargs}``) and answers one JSON line
(``{"ok": result}`` or ``{"error": text}``) on the original stdout; everything else it
or kvd prints goes to stderr. Engines are played through `kvd.client`, as a real
engine would be.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvd.client import KvdClient, RankHandle
from kvd.tools.localcluster import DaemonProcess
from kvd.tools.sim import EngineShape, check_shard, global_kv, layout_spec, write_shard
from kvd.wire.protocol import ModelSpec


class Node:
    """The node's daemons (by name) and engines (by engine id)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.daemons: dict[str, DaemonProcess] = {}
        self.clients: dict[str, KvdClient] = {}
        self.engines: dict[str, tuple[str, ModelSpec, EngineShape, list[RankHandle]]] = {}

    # ------------------------------------------------------------ daemons

    def start_daemon(self, name: str, peer_address: str, token: str, engine_port: int,
                     metrics_port: int, args: list[str], env: dict[str, str] | None = None,
                     engine_host: str = "127.0.0.1",
                     client_env: dict[str, str] | None = None) -> dict[str, Any]:
        token_file = self.log_dir / f"{name}.token"
        token_file.write_text(token + "\n")
        # The engines played here do not ping (a ping thread would share the client's
        # socket with the test's calls): the daemon keeps silent engines for 10 minutes.
        extra = ["--auth-token-file", str(token_file), "--set", "pool_backing=shm",
                 "--set", "engine_timeout_s=600", *args]
        d = DaemonProcess._spawn(name, self.log_dir, extra, env,
                                 f"tcp://{engine_host}:{engine_port}", peer_address,
                                 metrics_port, token)
        # What this node's engines read (KVD_CLIENT_CURVE_*_FILE for a CURVE engine face).
        for var in ("KVD_CLIENT_CURVE_SECRET_KEY_FILE", "KVD_CLIENT_CURVE_SERVER_KEY_FILE"):
            os.environ.pop(var, None)
        os.environ.update(client_env or {})
        t0 = time.monotonic()
        d.wait_ready(30.0)
        self.daemons[name] = d
        # A daemon whose loop UCX stalls for seconds after a heal must not fail the calls.
        self.clients[name] = d.client(ping_interval_s=0, timeout_s=60)
        return {"pid": d.proc.pid, "ready_s": time.monotonic() - t0}

    def kill_daemon(self, name: str) -> None:
        d = self.daemons[name]
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait(10)
        self.clients.pop(name).close()
        for eid in [e for e, v in self.engines.items() if v[0] == name]:
            del self.engines[eid]  # the daemon took its pools with it

    def restart_daemon(self, name: str) -> dict[str, Any]:
        """Start again on the same addresses; seconds until /livez and the engine face answer."""
        old = self.daemons[name]
        _keep_log(old.log_path)
        t0 = time.monotonic()
        d = DaemonProcess._spawn(name, self.log_dir, old.extra_args, None, old.engine_address,
                                 old.peer_address, old.metrics_port, old.token)
        livez_s = None
        while time.monotonic() - t0 < 30:
            if d.proc.poll() is not None:
                raise RuntimeError(f"restart exited {d.proc.returncode}: "
                                   f"{d.log_path.read_text()[-1500:]}")
            try:
                if self.livez(name, d.metrics_port) == 200:
                    livez_s = time.monotonic() - t0
                    break
            except OSError:
                time.sleep(0.02)
        d.wait_ready(30.0)
        self.daemons[name] = d
        # A daemon whose loop UCX stalls for seconds after a heal must not fail the calls.
        self.clients[name] = d.client(ping_interval_s=0, timeout_s=60)
        return {"livez_s": livez_s, "ready_s": time.monotonic() - t0}

    def signal_daemon(self, name: str, sig: str) -> None:
        """SIGSTOP / SIGCONT: a frozen daemon (a stalled host, a debugger) keeps its TCP
        connections: the kernel still acknowledges, the process answers nothing."""
        os.kill(self.daemons[name].proc.pid, getattr(signal, sig))

    def replace_daemon(self, name: str, args: list[str]) -> dict[str, Any]:
        """Stop the daemon and start it again, same addresses, with other arguments."""
        old = self.daemons[name]
        self.clients.pop(name).close()
        old.stop()
        _keep_log(old.log_path)
        for eid in [e for e, v in self.engines.items() if v[0] == name]:
            del self.engines[eid]
        return self.start_daemon(name, old.peer_address, old.token,
                                 int(old.engine_address.rsplit(":", 1)[1]), old.metrics_port,
                                 args)

    def returncode(self, name: str) -> int | None:
        return self.daemons[name].proc.poll()

    def crash_site(self, name: str) -> str:
        """The innermost Python frame of the crashed thread, from faulthandler's dump in
        the daemon's log ("" when there is none)."""
        lines = self.daemons[name].log_path.read_text(errors="replace").splitlines()
        for i in range(len(lines) - 1, -1, -1):
            if lines[i].startswith("Current thread") and i + 1 < len(lines):
                return lines[i + 1].strip()
        return ""

    def alive(self, name: str) -> bool:
        return self.daemons[name].proc.poll() is None

    def livez(self, name: str, port: int | None = None) -> int:
        port = port or self.daemons[name].metrics_port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=1) as resp:
            resp.read()
            return resp.status

    def metric(self, name: str, metric: str, **labels: str) -> float:
        return self.daemons[name].metric(metric, **labels)

    def rss_bytes(self, name: str) -> int:
        for line in Path(f"/proc/{self.daemons[name].proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def remote_status(self, address: str, token: str = "",
                      env: dict[str, str] | None = None) -> Any:
        """A status call to another node's engine face (with this node's env plus env)."""
        saved = dict(os.environ)
        os.environ.update(env or {})
        try:
            with KvdClient(address, token=token, ping_interval_s=0, timeout_s=10) as c:
                return msgspec.to_builtins(c.status())
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def status(self, name: str) -> Any:
        return msgspec.to_builtins(self.clients[name].status())

    def stop_all(self) -> dict[str, int]:
        for c in self.clients.values():
            c.close()
        return {n: d.stop() for n, d in self.daemons.items()}

    # ------------------------------------------------------------ engines

    def register(self, daemon: str, engine_id: str, model: dict[str, Any], tp_size: int,
                 num_blocks: int, kv_layout: str = "kv_split") -> None:
        spec = msgspec.convert(model, ModelSpec)
        shape = EngineShape(tp_size=tp_size, num_blocks=num_blocks, kv_layout=kv_layout)
        client = self.clients[daemon]
        ranks = [client.register(engine_id, spec, layout_spec(shape), t, tp_size)
                 for t in range(tp_size)]
        self.engines[engine_id] = (daemon, spec, shape, ranks)

    def write(self, engine_id: str, block_ids: list[int], tokens: int, seed: int) -> None:
        _, spec, shape, ranks = self.engines[engine_id]
        g = global_kv(spec, tokens, seed=seed)
        for r in ranks:
            write_shard(r.kv, g, spec, shape, r.tp_rank, r.pp_rank, block_ids)

    def check(self, engine_id: str, block_ids: list[int], tokens: int, seed: int) -> int:
        """Mismatching elements against the global pattern (0: byte-exact)."""
        _, spec, shape, ranks = self.engines[engine_id]
        g = global_kv(spec, tokens, seed=seed)
        return sum(check_shard(r.kv, g, spec, shape, r.tp_rank, r.pp_rank, block_ids)
                   for r in ranks)

    def fill(self, engine_id: str, byte: int) -> None:
        """The engine reuses its whole pool: every byte becomes ``byte``."""
        for r in self.engines[engine_id][3]:
            r.kv.reshape(-1).view(np.uint8)[:] = byte

    def count_not(self, engine_id: str, byte: int) -> int:
        """Bytes of the whole pool that are not ``byte`` (a late write shows here)."""
        return sum(int(np.count_nonzero(r.kv.reshape(-1).view(np.uint8) != byte))
                   for r in self.engines[engine_id][3])

    def publish(self, engine_id: str, request_id: str, block_ids: list[int],
                lease_s: float | None = None) -> None:
        self.clients[self.engines[engine_id][0]].publish(engine_id, request_id, block_ids,
                                                         lease_s)

    def pull(self, engine_id: str, request_id: str, remote_engine_id: str, remote_address: str,
             remote_block_ids: list[int], local_block_ids: list[int], num_tokens: int) -> float:
        self.clients[self.engines[engine_id][0]].pull(
            engine_id, request_id, remote_engine_id, remote_address, remote_block_ids,
            local_block_ids, num_tokens=num_tokens)
        return time.monotonic()

    def wait(self, engine_id: str, request_id: str, kind: str, timeout_s: float
             ) -> dict[str, Any]:
        ev = self.clients[self.engines[engine_id][0]].wait(engine_id, request_id, kind,
                                                           timeout_s=timeout_s)
        return {**msgspec.to_builtins(ev), "at": time.monotonic()}

    def now(self) -> float:
        return time.monotonic()

    def iface_bytes(self, dev: str) -> int:
        """Bytes through one of this node's interfaces, both directions, from its own
        counters (/sys/class/net/DEV/statistics)."""
        stats = Path("/sys/class/net") / dev / "statistics"
        return sum(int((stats / f).read_text()) for f in ("rx_bytes", "tx_bytes"))


def _keep_log(path: Path) -> None:
    """A restarted daemon's log would overwrite its predecessor's (a crash's stacks)."""
    if path.exists():
        path.rename(path.with_name(f"{path.stem}.{time.monotonic_ns()}.log"))


def main() -> int:
    if os.environ.get("KVD_MULTINODE_CORES"):  # gdb a daemon's crash: core files in its cwd
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints must not corrupt the answers
    node = Node(Path(sys.argv[1]))
    node.log_dir.mkdir(parents=True, exist_ok=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            result = getattr(node, op)(**cmd)
            out.write(json.dumps({"ok": result}) + "\n")
        except Exception as exc:  # noqa: BLE001 - reported to the harness, which raises
            out.write(json.dumps({"error": f"{op}: {exc!r}\n{traceback.format_exc()}"}) + "\n")
        if op == "stop_all":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
