"""Batch stalls (a gap > MIN_MS shared by every stream of a batch) and the first single's
daemon pull, against what ran on the CPUs meanwhile (perf sched, CLOCK_MONOTONIC)."""
import re, sys, json, collections, glob
D = sys.argv[1]; MIN_MS = float(sys.argv[2]) if len(sys.argv) > 2 else 30
run = json.load(open(f"{D}/run.json"))
rx = re.compile(r"^\s*(.+?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:(\w+):\s+(.*)$")
sw = re.compile(r"prev_comm=(.*) prev_pid=(\d+) prev_prio=(\d+) prev_state=(\S+) ==> next_comm=(.*) next_pid=(\d+) next_prio=(\d+)")
ev = []; tid2pid = {}; pidcomm = {}
for line in open(f"{D}/perf.txt"):
    m = rx.match(line)
    if m:
        comm, pid, tid, cpu, t, name, rest = m.groups()
        ev.append((float(t), int(cpu), name, rest)); tid2pid[int(tid)] = int(pid)
procs = {}
for line in open(f"{D}/pids"):
    p = line.split(None, 1)
    if p and p[0].isdigit(): procs[int(p[0])] = p[1][:60].strip()
def who(tid, comm):
    pid = tid2pid.get(tid, tid)
    return f"{comm}[{pid}]"
def window(lo, hi, label):
    run_t = collections.Counter(); last = {}
    for t, cpu, name, rest in ev:
        if t < lo - 1.0: continue
        if t > hi: break
        if name != "sched_switch": continue
        m = sw.match(rest); pc, pp, _, ps, nc, np_, npr = m.groups()
        if cpu in last:
            lt, lw = last[cpu]
            a, b = max(lt, lo), min(t, hi)
            if b > a: run_t[lw] += b - a
        last[cpu] = (t, who(int(np_), nc))
    for cpu, (lt, lw) in last.items():
        a = max(lt, lo)
        if hi > a: run_t[lw] += hi - a
    print(f"{label}: {(hi-lo)*1e3:.1f} ms window; CPU ms by thread:",
          ", ".join(f"{k} {v*1e3:.1f}" for k, v in run_t.most_common(10)))
t_lo, t_hi = ev[0][0], ev[-1][0]
for b in run["batches"]:
    if b["system"] == "plain" or not b.get("tokens_s"): continue
    s0 = b["tokens_s"][0]
    for a, c in zip(s0, s0[1:]):
        if (c - a) * 1e3 < MIN_MS or not (t_lo < a < t_hi): continue
        shared = all(any(x <= a + 0.005 and y >= c - 0.005 and (y - x) * 1e3 >= MIN_MS
                         for x, y in zip(s, s[1:])) for s in b["tokens_s"])
        window(a, c, f"batch {b['round']} gap at +{(a-b['sent_s'])*1e3:.0f} ms"
               f" ({'all streams' if shared else 'one stream'})")
print("processes:"); [print(" ", k, v) for k, v in procs.items()]
# daemon pulls: the earliest (a pair's first) and the slowest, with what ran meanwhile
pts = collections.defaultdict(dict)
for f in glob.glob(f"{D}/work/trace/*.trace"):
    for line in open(f):
        p = line.split()
        if len(p) >= 3: pts[p[2]].setdefault(p[1], int(p[0]) / 1e9)
pulls = sorted((v["daemon_pull"], v["daemon_event"], r) for r, v in pts.items()
               if "daemon_pull" in v and "daemon_event" in v)
print("daemon pulls (took it -> event queued), ms, in time order:",
      [round((e - s) * 1e3, 2) for s, e, _ in pulls[:12]])
for s, e, r in pulls[:2] + sorted(pulls, key=lambda x: x[0] - x[1])[:3]:
    if t_lo < s < t_hi:
        window(s, e, f"pull {r}")
# the daemon's page faults (perf script of faults.data) inside each pull's window
import os, bisect
if os.path.exists(f"{D}/faults.txt"):
    ft = sorted(float(m.group(1)) for m in (re.search(r"\s([\d.]+):\s+exceptions:", l)
                                          for l in open(f"{D}/faults.txt")) if m)
    print("daemon page faults recorded:", len(ft))
    rows = []
    for s, e, r in pulls:
        n = bisect.bisect_right(ft, e) - bisect.bisect_left(ft, s)
        rows.append((s, r, round((e - s) * 1e3, 2), n))
    for s, r, ms, n in rows[:8]:
        print(f"  {r}: {ms} ms, {n} faults")
    print("  faults per pull, all:", [n for *_, n in rows])
