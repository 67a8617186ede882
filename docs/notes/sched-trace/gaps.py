"""Late daemon reads of pulls, against what the scheduler did meanwhile (perf sched)."""
import re, sys, collections, glob, os
D = sys.argv[1]; DPID = int(sys.argv[2]); MIN_MS = float(sys.argv[3]) if len(sys.argv) > 3 else 10
pts = collections.defaultdict(dict)
for f in glob.glob(f"{D}/work/trace/*.trace"):
    for line in open(f):
        p = line.split()
        if len(p) >= 3:
            pts[p[2]].setdefault(p[1], int(p[0]) / 1e9)
lat = [(v["pull_sent"], v["daemon_pull"], r) for r, v in pts.items() if "pull_sent" in v and "daemon_pull" in v]
rx = re.compile(r"^\s*(.+?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:(\w+):\s+(.*)$")
ev = []
for line in open(f"{D}/perf.txt"):
    m = rx.match(line)
    if m:
        comm, pid, tid, cpu, t, name, rest = m.groups()
        ev.append((float(t), int(cpu), name, comm.strip(), int(pid), int(tid), rest))
t_lo, t_hi = ev[0][0], ev[-1][0]
tid2pid = {}
for e in ev:
    tid2pid[e[5]] = e[4]
def pidof(tid):
    return tid2pid.get(tid, -1)
sw = re.compile(r"prev_comm=(.*) prev_pid=(\d+) prev_prio=(\d+) prev_state=(\S+) ==> next_comm=(.*) next_pid=(\d+) next_prio=(\d+)")
wk = re.compile(r"comm=(.*) pid=(\d+) prio=(\d+) target_cpu=(\d+)")
for sent, read, rid in sorted(lat):
    if not (t_lo < sent < t_hi) or (read - sent) * 1e3 < MIN_MS:
        continue
    print(f"\n== {rid}: sent {sent:.4f} read +{(read-sent)*1e3:.1f} ms")
    running = collections.Counter(); last = {}
    for t, cpu, name, comm, pid, tid, rest in ev:
        if t < sent - 0.002: continue
        if t > read + 0.001: break
        if name == "sched_switch":
            m = sw.match(rest); pc, pp, _, ps, nc, np_, npr = m.groups()
            pp, np_ = int(pp), int(np_)
            if cpu in last:
                lt, lc = last[cpu]; running[lc] += t - max(lt, sent)
            last[cpu] = (t, f"{nc}:{np_}")
            if pidof(pp) == DPID or pidof(np_) == DPID:
                print(f"  {(t-sent)*1e3:8.2f} cpu{cpu} {pc}:{pp}({ps}) -> {nc}:{np_}(prio {npr})")
        elif name == "sched_wakeup":
            m = wk.match(rest); c, p, pr, tc = m.groups()
            if pidof(int(p)) == DPID:
                print(f"  {(t-sent)*1e3:8.2f} wakeup {c}:{p} on cpu{tc} by {comm}:{tid}")
    print("  CPU time by task in window (ms):", ", ".join(f"{k} {v*1e3:.1f}" for k, v in running.most_common(8)))
