"""Wake-up to run latency per thread (perf sched tracepoints)."""
import re, sys, collections
rx = re.compile(r"^\s*(.+?)\s+(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):\s+sched:(\w+):\s+(.*)$")
sw = re.compile(r"prev_comm=(.*) prev_pid=(\d+) prev_prio=(\d+) prev_state=(\S+) ==> next_comm=(.*) next_pid=(\d+) next_prio=(\d+)")
wk = re.compile(r"comm=(.*) pid=(\d+) prio=(\d+) target_cpu=(\d+)")
woke = {}; lat = collections.defaultdict(list); names = {}; tid2pid = {}
for line in open(sys.argv[1]):
    m = rx.match(line)
    if not m: continue
    comm, pid, tid, cpu, t, name, rest = m.groups(); t = float(t)
    tid2pid[int(tid)] = int(pid)
    if name == "sched_wakeup":
        a = wk.match(rest).groups(); woke[int(a[1])] = t; names[int(a[1])] = a[0]
    elif name == "sched_switch":
        a = sw.match(rest).groups(); n = int(a[5])
        if n in woke:
            lat[n].append(t - woke.pop(n))
want = [int(x) for x in sys.argv[2:]]
for tid, v in sorted(lat.items(), key=lambda kv: -len(kv[1])):
    pid = tid2pid.get(tid)
    if want and pid not in want and tid not in want: continue
    v.sort(); n = len(v)
    print(f"{names[tid]:16} {pid}/{tid} n={n:5} p50={v[n//2]*1e3:6.2f} p90={v[int(n*.9)]*1e3:6.2f} p99={v[int(n*.99)]*1e3:7.2f} max={v[-1]*1e3:7.2f} ms")
