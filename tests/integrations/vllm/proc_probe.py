"""What the kernel says about a process tree's threads: names, states, affinities,
run-queue waits, and the host's real-time threads (tests/integrations/vllm/repro_decode_stall.py).

Standard library only: /proc, read from outside, never stopping anyone.
"""

from __future__ import annotations

import os
from typing import Any


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [root], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            found.append(pid)
            todo.append(pid)
    return found


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def threads_of(pid: int) -> list[dict[str, Any]]:
    """Per thread: tid, name, state, affinity, run-queue wait (s), on-CPU time (s)."""
    out = []
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return out
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        stat = read(f"{base}/stat")
        state = stat.rsplit(")", 1)[1].split()[0] if ")" in stat else "?"
        sched = read(f"{base}/schedstat").split()
        try:
            aff = sorted(os.sched_getaffinity(tid))
        except OSError:
            aff = []
        out.append({
            "tid": tid, "comm": read(f"{base}/comm"), "state": state, "cpus": aff,
            "run_s": int(sched[0]) / 1e9 if len(sched) > 1 else None,
            "wait_s": int(sched[1]) / 1e9 if len(sched) > 1 else None,
            "wchan": read(f"{base}/wchan"),
        })
    return out


def non_fair_threads() -> list[str]:
    """Every thread on the host outside the fair class (policy field of /proc stat):
    a real-time thread takes a core from every fair one, pinned ones included."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            stat = read(f"/proc/{pid}/task/{tid}/stat")
            if ")" not in stat:
                continue
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            # fields[0] is field 3 (state); policy is field 41, rt_priority 40.
            kernel = comm.startswith(("migration/", "watchdogd", "irq/"))
            if len(fields) > 38 and fields[38] not in ("0", "3", "5") and not kernel:
                found.append(f"{pid}/{tid} {comm} policy={fields[38]} rtprio={fields[37]}")
    return found


def wait_deltas(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Threads by run-queue wait between two snapshots, longest first."""
    rows = []
    for name in ("prefill", "decode"):
        for pid, proc in b.get(name, {}).items():
            before = {t["tid"]: t for t in a.get(name, {}).get(pid, {}).get("threads", [])}
            for t in proc["threads"]:
                t0 = before.get(t["tid"])
                if t0 is None or t["wait_s"] is None or t0["wait_s"] is None:
                    continue
                rows.append({"engine": name, "proc": proc["comm"], "thread": t["comm"],
                             "cpus": t["cpus"], "wait_s": round(t["wait_s"] - t0["wait_s"], 3),
                             "run_s": round(t["run_s"] - t0["run_s"], 3)})
    return sorted(rows, key=lambda r: -r["wait_s"])
