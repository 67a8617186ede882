"""Run: .venv/bin/python scripts/trace_pull.py

Which kvd modules one Pull passes through, from the engine face to its answer.

Runs a prefill and a decode daemon in-process (LoopbackTransport, fake clock), warms
the handshake with one pull, then traces a second pull: every call from one kvd module
into another, from the decode face receiving the Pull to the event's answer."""
import collections
import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests"))
from support.inprocess import daemon_pair, run, wait_event

from kvd.tools.sim import EngineShape, layout_spec
from kvd.wire import protocol as P

MODEL = P.ModelSpec(name="t", num_kv_heads=2, num_layers=2, head_dim=8)
SHAPE = EngineShape(tp_size=1, num_blocks=8)
calls = []

def tracer(frame, event, arg):
    if event != "call":
        return None
    mod = frame.f_globals.get("__name__", "")
    back = frame.f_back
    caller = back.f_globals.get("__name__", "") if back else ""
    if mod.startswith("kvd.") and caller.startswith("kvd.") and mod != caller:
        calls.append((caller, mod, frame.f_code.co_name))
    return None

async def body():
    async with daemon_pair() as p:
        await p.pc.register("pre", MODEL, layout_spec(SHAPE), 0, 1)
        await p.dc.register("dec", MODEL, layout_spec(SHAPE), 0, 1)
        for rid in ("warm", "traced"):
            await p.pc.publish("pre", rid, [1, 2])
            if rid == "traced":
                sys.settrace(tracer)
            await p.dc.pull("dec", rid, "pre", p.prefill.cfg.peer_address, [1, 2], [3, 4])
            ev = await wait_event(p.dc, p.clock, "dec", rid, "done_recving")
            sys.settrace(None)
            assert ev.ok, ev.error

run(body())
pull_mods = [c for c in calls if c[0].startswith("kvd.daemon") or c[1].startswith("kvd.daemon")]
entered = collections.Counter(m for _, m, _ in pull_mods)
print("calls between kvd modules on the pull's path (caller -> callee: function):")
last = None
for caller, mod, fn in pull_mods:
    line = f"  {caller} -> {mod}: {fn}"
    if line != last:
        print(line)
    last = line
print("\nentries per module:", dict(entered.most_common()))
