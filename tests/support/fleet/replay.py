"""Replaying and shrinking a seed of the fleet simulation (tests/support/fleet.sim)."""

from __future__ import annotations

from support.fleet.faults import Fault, Knobs, fault_schedule
from support.fleet.sim import Sim


def run(seed: int, faults: list[Fault] | None = None, knobs: Knobs | None = None) -> Sim:
    """One run; raises `Violation` (or whatever kvd raised) on the first broken invariant."""
    return Sim(seed, faults, knobs).run()


def fails(seed: int, faults: list[Fault], knobs: Knobs | None = None) -> str | None:
    """The failure of this run, as text (None: it passed)."""
    try:
        run(seed, faults, knobs)
    except Exception as exc:  # noqa: BLE001 - any exception out of kvd is a failure too
        return f"{type(exc).__name__}: {exc}"
    return None


def shrink(seed: int, faults: list[Fault] | None = None, knobs: Knobs | None = None
           ) -> list[Fault]:
    """The shortest fault trace (1-minimal: dropping any one more fault makes the run
    pass) that still fails, by delta debugging: drop halves, then single faults."""
    knobs = knobs or Knobs()
    trace = fault_schedule(seed, knobs) if faults is None else list(faults)
    if fails(seed, trace, knobs) is None:
        raise ValueError(f"seed {seed} passes with these faults: nothing to shrink")
    n = 2
    while len(trace) >= 2:
        chunk = max(1, len(trace) // n)
        parts = [trace[i:i + chunk] for i in range(0, len(trace), chunk)]
        for i in range(len(parts)):
            rest = [f for j, p in enumerate(parts) if j != i for f in p]
            if fails(seed, rest, knobs) is not None:
                trace, n = rest, max(n - 1, 2)
                break
        else:
            if chunk == 1:
                break
            n = min(len(trace), n * 2)
    if len(trace) == 1 and fails(seed, [], knobs) is not None:
        trace = []
    return trace


def report(seed: int, knobs: Knobs | None = None) -> str:
    """What a failing seed prints: its failure, the full fault schedule, the shrunk one, and
    how to replay it."""
    knobs = knobs or Knobs()
    full = fault_schedule(seed, knobs)
    why = fails(seed, full, knobs)
    if why is None:
        return f"seed {seed} passes"
    small = shrink(seed, full, knobs)
    lines = [f"seed {seed} fails: {why}", f"fault schedule ({len(full)}):",
             *(f"  {f}" for f in full), f"shortest failing trace ({len(small)}): "
             f"{fails(seed, small, knobs)}", *(f"  {f!r}" for f in small),
             f"replay: KVD_SIM_SEED={seed} .venv/bin/python -m pytest -q "
             "tests/daemon/test_fleet_sim.py -k replay  (or fleet.run(seed, faults=[...]))"]
    return "\n".join(lines)
