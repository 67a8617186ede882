"""Starting and stopping the systems of one ``kvd bench vllm`` run (vllm_run): each
system's daemons (``kvd serve``), its vLLM OpenAI servers (this interpreter, so the
venv that has vLLM) and its ``kvd router``; every process in a session of its own, so
that a system is paused, continued and stopped whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvd.errors import KvdError
from kvd.ops.trace import ENV as TRACE_ENV
from kvd.tools.bench.vllm_procs import Proc, healthy, session_cpu_s, warming
from kvd.tools.bench.vllm_systems import BenchConfig, SystemSpec, engine_args, system_spec
from kvd.tools.localcluster import DaemonProcess, free_port

# An engine or router that exits because another process took its port between the
# pick and the bind (anything else on the host picking free ports: another test's
# `kvd demo`) is started again on a new port, at most this many times.
BIND_TRIES = 3
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
              "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
              "VLLM_LOGGING_LEVEL": "WARNING"}


@dataclass
class Running:
    spec: SystemSpec
    ports: dict[str, int]  # role -> server port ("plain" | "prefill" | "decode")
    router_port: int = 0
    procs: list[Proc] = field(default_factory=list)
    daemons: list[DaemonProcess] = field(default_factory=list)


@dataclass
class Launch:
    """An engine to start: its server's arguments (a port among them) and environment."""

    run: Running
    role: str
    name: str
    args: list[str]
    env: dict[str, str]
    tries: int = 1

    @property
    def port(self) -> int:
        return int(self.args[self.args.index("--port") + 1])

    def rebind(self) -> bool:
        """New ports (the server's, NIXL's side channel) for another try; False when
        it has had its BIND_TRIES."""
        if self.tries >= BIND_TRIES:
            return False
        self.tries += 1
        port = free_port()
        self.args[self.args.index("--port") + 1] = str(port)
        self.run.ports[self.role] = port
        if "VLLM_NIXL_SIDE_CHANNEL_PORT" in self.env:
            self.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
        return True


def stop_system(run: Running) -> None:
    """Stop a system's processes, the last started first, then its daemons, whatever fails."""
    for proc in reversed(run.procs):
        with contextlib.suppress(Exception):
            proc.stop()
    for d in run.daemons:
        with contextlib.suppress(Exception):
            d.stop()


class Launcher:
    """Starts the run's systems into ``systems`` as it goes, so that whoever holds the
    dict stops what did start when a later start fails."""

    def __init__(self, cfg: BenchConfig, work: Path, model: str, log: Callable[[str], None],
                 systems: dict[str, Running]) -> None:
        self.cfg = cfg
        self.work = work
        self.model = model
        self.log = log
        self.systems = systems

    def start(self) -> None:
        """Every system's daemons, engines (``start_parallel`` at once, each started
        again on new ports if its port was taken meanwhile) and router, up."""
        pending: list[Launch] = []
        for name in self.cfg.systems:
            spec = system_spec(name)
            run = Running(spec, {})
            self.systems[name] = run
            homes, peers = {}, {}
            daemon_env = {TRACE_ENV: str(self.work / "trace")} if self.cfg.breakdown else None
            for d in spec.daemons:
                daemon = DaemonProcess.start(d.name, self.work, list(d.extra_args),
                                             env=daemon_env,
                                             timeout_s=self.cfg.daemon_start_timeout_s)
                run.daemons.append(daemon)
                homes[d.name] = daemon.engine_address
                peers[d.name] = daemon.peer_address
            prefill = next((e for e in spec.engines if e.role == "prefill"), None)
            for e in spec.engines:
                port = free_port()
                run.ports[e.role] = port
                cfg = None
                if e.kv_transfer_config is not None:
                    cfg = json.loads(json.dumps(e.kv_transfer_config))
                    if e.daemon is not None:
                        extra = cfg["kv_connector_extra_config"]
                        extra["kvd_address"] = homes[e.daemon]
                        if e.role == "decode" and prefill is not None and prefill.daemon:
                            # as an operator would: the decode names its producer, and
                            # its daemon greets the prefill's ahead of the first pull
                            extra["kvd_producers"] = [{"engine_id": prefill.name,
                                                       "address": peers[prefill.daemon]}]
                env = dict(ENGINE_ENV)
                if self.cfg.breakdown and e.daemon is not None:
                    env[TRACE_ENV] = str(self.work / "trace")
                if e.nixl_side_channel:
                    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
                args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                        *engine_args(self.model, port, self.cfg.kv_cache_bytes,
                                     self.cfg.max_model_len, cfg,
                                     self.cfg.max_num_batched_tokens)]
                pending.append(Launch(run, e.role, e.name, args, env))
        starting: list[tuple[Proc, Launch]] = []
        deadline = time.monotonic() + self.cfg.start_timeout_s
        t0 = time.monotonic()
        while pending or starting:
            while pending and len(starting) < self.cfg.start_parallel:
                launch = pending.pop(0)
                proc = Proc.start(launch.name, launch.args, self.work, launch.env)
                launch.run.procs.append(proc)
                starting.append((proc, launch))
            for proc, launch in list(starting):
                exited = proc.proc.poll() is not None
                if exited or proc.port_taken():
                    starting.remove((proc, launch))
                    if not (proc.port_taken() and launch.rebind()):
                        raise KvdError(f"engine {proc.name} exited with "
                                       f"{proc.proc.returncode}:\n{proc.tail()}")
                    if not exited:  # a thread's bind failed: it would never come up
                        proc.stop()
                    self.log(f"  {proc.name}: its port was taken meanwhile; starting it "
                             f"again on port {launch.port}")
                    pending.insert(0, launch)
                elif healthy(launch.port):
                    self.log(f"  {proc.name} up after {time.monotonic() - t0:.0f} s")
                    starting.remove((proc, launch))
            if time.monotonic() > deadline:
                raise KvdError(self.not_up(f"engines not up within "
                                            f"{self.cfg.start_timeout_s} s",
                                            [p for p, _ in starting]))
            time.sleep(1.0)
        routers = {name: self.start_router(run) for name, run in self.systems.items()
                   if run.spec.disaggregated}
        for name, run in self.systems.items():
            tries = 1
            while run.router_port and not healthy(run.router_port):
                proc = routers[name]
                if proc.proc.poll() is not None:
                    if not proc.bind_failed() or tries >= BIND_TRIES:
                        raise KvdError(f"router of {name} exited with "
                                       f"{proc.proc.returncode}:\n{proc.tail()}")
                    tries += 1
                    routers[name] = self.start_router(run)
                if time.monotonic() > deadline:
                    raise KvdError(self.not_up(f"router of {name} not up", [proc]))
                time.sleep(0.2)
            while self.cfg.router_warm_up and run.router_port and warming(run.router_port):
                if time.monotonic() > deadline:
                    raise KvdError(f"router of {run.spec.name} did not warm its pair up")
                time.sleep(0.2)

    def start_router(self, run: Running) -> Proc:
        run.router_port = free_port()
        proc = Proc.start(f"{run.spec.name}-router", [
            sys.executable, "-m", "kvd", "router",
            "--prefill", f"http://127.0.0.1:{run.ports['prefill']}",
            "--decode", f"http://127.0.0.1:{run.ports['decode']}",
            "--port", str(run.router_port), *run.spec.router_args,
            *(["--warm-up"] if self.cfg.router_warm_up else [])], self.work)
        run.procs.append(proc)
        return proc

    @staticmethod
    def not_up(what: str, procs: list[Proc]) -> str:
        """What did not come up, with what tells a starved host from a hang: the
        host's load, and each process's CPU time so far and its log's end."""
        lines = [f"{what} (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus):"]
        for p in procs:
            lines.append(f"--- {p.name}: running, {session_cpu_s(p.proc.pid):.0f} CPU s "
                         f"used so far; log {p.log_path}, its end:\n{p.tail(1500)}")
        return "\n".join(lines)
