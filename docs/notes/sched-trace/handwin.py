import sys, json
sys.argv = [sys.argv[0], sys.argv[1], "1000"]
exec(open("/tmp/runs/stalls.py").read().split("t_lo, t_hi = ev[0][0], ev[-1][0]")[0])
t_lo, t_hi = ev[0][0], ev[-1][0]
import glob, collections
pts = collections.defaultdict(dict)
for f in glob.glob(f"{D}/work/trace/*.trace"):
    for line in open(f):
        p = line.split()
        if len(p) >= 3: pts[p[2]].setdefault(p[1], int(p[0]) / 1e9)
for b in run["batches"]:
    if b["system"] == "plain": continue
    lo = b["sent_s"]; ft = min(b["first_token_s"])
    rep = [v["recv_reported"] for v in pts.values() if "recv_reported" in v and lo < v["recv_reported"] < ft]
    if rep:
        window(max(rep), ft, f"batch {b['round']}: last KV reported -> first token")
for s in run["singles"][:0]: pass
