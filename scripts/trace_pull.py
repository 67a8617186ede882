"""Run: .venv/bin/python scripts/trace_pull.py [--remote] [--modules]

One pull's call trace: every kvd function one 1-block pull calls, in order.

Runs daemons in-process (LoopbackTransport, fake clock). By default the pull is local
(both engines on one daemon: the pull is a copy in that daemon); ``--remote`` pulls
between two daemons. One pull warms the handshake (and the plan cache); the second is
traced with ``sys.setprofile`` (and ``threading.setprofile``, for the copier's
threads) from the decode face receiving the Pull to the engine reading its answer.

Printed: the kvd functions called, in order (a run of calls to the same function is one
line with its count), then how many calls and distinct functions, and the calls per
module. ``--modules``: only the calls from one kvd module into another (the earlier
form of this tool).
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.inprocess import daemon_pair, run, wait_event  # noqa: E402

from kvd.tools.sim import EngineShape, layout_spec  # noqa: E402
from kvd.wire import protocol as P  # noqa: E402

MODEL = P.ModelSpec(name="t", num_kv_heads=2, num_layers=2, head_dim=8)
SHAPE = EngineShape(tp_size=1, num_blocks=8)
# Only the daemon's pull path: the client, the fake clock and the wire codec are the
# harness, not the pull.
TRACED = ("kvd.daemon.", "kvd.transport.", "kvd.planner.", "kvd.pool.")

calls: list[tuple[str, str, str]] = []  # (caller module, module, function)


def _profile(frame: Any, event: str, arg: Any) -> None:
    if event != "call":
        return
    mod = frame.f_globals.get("__name__", "")
    if not mod.startswith(TRACED):
        return
    back = frame.f_back
    caller = back.f_globals.get("__name__", "") if back is not None else ""
    calls.append((caller, mod, frame.f_code.co_qualname))


async def _body(remote: bool) -> None:
    async with daemon_pair() as p:
        producer = p.prefill
        pc = p.pc
        dc = p.dc if remote else p.pc  # local: the consumer engine on the same daemon
        await pc.register("pre", MODEL, layout_spec(SHAPE), 0, 1)
        await dc.register("dec", MODEL, layout_spec(SHAPE), 0, 1)
        for rid in ("warm", "traced"):
            await pc.publish("pre", rid, [1])
            if rid == "traced":
                threading.setprofile(_profile)
                sys.setprofile(_profile)
            await dc.pull("dec", rid, "pre", producer.cfg.peer_address, [1], [3])
            ev = await wait_event(dc, p.clock, "dec", rid, "done_recving")
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
            assert ev.ok, ev.error


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    ap.add_argument("--remote", action="store_true", help="pull between two daemons")
    ap.add_argument("--modules", action="store_true",
                    help="only the calls from one kvd module into another")
    args = ap.parse_args()
    run(_body(args.remote))
    kind = "remote" if args.remote else "local"
    if args.modules:
        print(f"calls between kvd modules on one {kind} 1-block pull (caller -> callee):")
        rows = [f"  {c} -> {m}: {f}" for c, m, f in calls
                if c.startswith("kvd.") and c != m]
    else:
        print(f"kvd functions one {kind} 1-block pull calls, in order:")
        rows = [f"  {m}.{f}" for _, m, f in calls]
    last, n = None, 0
    for row in [*rows, None]:
        if row == last:
            n += 1
            continue
        if last is not None:
            print(last + (f"  x{n}" if n > 1 else ""))
        last, n = row, 1
    per_module = collections.Counter(m for _, m, _ in calls)
    print(f"\n{len(calls)} calls, {len({(m, f) for _, m, f in calls})} distinct functions, "
          f"{len(per_module)} modules")
    print("calls per module:", dict(per_module.most_common()))


if __name__ == "__main__":
    main()
