"""Split pull_sent -> daemon_pull into: engine I/O thread wait, and the rest (daemon side)."""
import re, sys, collections, glob, bisect
D, IOTID = sys.argv[1], int(sys.argv[2])
pts = collections.defaultdict(dict)
for f in glob.glob(f"{D}/work/trace/*.trace"):
    for line in open(f):
        p = line.split()
        if len(p) >= 3: pts[p[2]].setdefault(p[1], int(p[0]) / 1e9)
rx = re.compile(r"^\s*(.+?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:sched_switch:\s+(.*)$")
runs = []
for line in open(f"{D}/perf.txt"):
    m = rx.match(line)
    if m and f"next_pid={IOTID} " in m.group(6): runs.append(float(m.group(5)))
lo, hi = runs[0], runs[-1]
rows = []
for r, v in pts.items():
    if "pull_sent" in v and "daemon_pull" in v and lo < v["pull_sent"] < hi:
        # pull_sent is stamped after send(): the wake happened just before it
        i = bisect.bisect_left(runs, v["pull_sent"] - 0.0005)
        io = runs[i] if i < len(runs) else None
        rows.append(((v["daemon_pull"] - v["pull_sent"]) * 1e3, (io - v["pull_sent"]) * 1e3))
rows.sort()
print("n", len(rows))
for tot, io in rows[-15:]:
    print(f"sent->daemon read {tot:7.2f} ms   sent->engine I/O thread ran {io:7.2f} ms")
