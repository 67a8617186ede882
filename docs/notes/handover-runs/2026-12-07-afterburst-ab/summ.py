import json,glob,statistics as st,sys
rows={}
for t in ("after","noburst","before"):
    for f in sorted(glob.glob(f"/tmp/ab/{t}-*.json")):
        try: d=json.load(open(f))
        except Exception as e: print(f,e); continue
        s=d["scenarios"][0]
        loc=d.get("local") or {}
        lp=None
        if isinstance(loc,dict):
            lp=loc.get("pull_1block_p50_ms") or loc.get("local_1block_p50_ms")
        rows.setdefault(t,[]).append((s["ratio_kvd_nixl"],d["pull_1block_p50_ms"],d["ratio_pull_1block_floor"],lp))
for t,r in rows.items():
    print(t, "kvd/nixl64", [x[0] for x in r], "med", st.median(x[0] for x in r))
    print(t, "  remote1 p50", [x[1] for x in r], " /floor", [x[2] for x in r], "med", st.median(x[2] for x in r))
    print(t, "  local1", [x[3] for x in r])
