"""Records of the first eval's code (9fc5f0d) against today's code asked for the paper's rule and the legacy
protocol, on the same items: the same predictions and scores?"""
import json, sys
old = json.load(open(sys.argv[1]))["records"]
new = json.load(open(sys.argv[2]))["records"]
key = lambda r: (r["length"], r["task"], r["sample"], r["method"])
o, n = {key(r): r for r in old}, {key(r): r for r in new}
same_pred = same_score = same_prompt = 0
rows = []
for k in sorted(o):
    a, b = o[k], n.get(k)
    if b is None:
        rows.append((k, "missing in new")); continue
    sp, ss = a.get("prediction") == b.get("prediction"), a["score"] == b["score"]
    same_pred += sp; same_score += ss; same_prompt += a.get("prompt_hash") == b.get("prompt_hash")
    if not sp:
        rows.append((k, f"old {a.get('prediction')!r} ({a['score']}) / new {b.get('prediction')!r} ({b['score']})"))
print(f"{len(o)} records: same prompt {same_prompt}, same prediction {same_pred}, same score {same_score}")
for k, msg in rows:
    print(k, msg)
for m in ("full", "tailorkv"):
    for L in sorted({k[0] for k in o}):
        so = [o[k]["score"] for k in o if k[3] == m and k[0] == L]
        sn = [n[k]["score"] for k in n if k[3] == m and k[0] == L]
        print(f"{m} {L}: old mean {sum(so)/len(so):.1f}, new mean {sum(sn)/max(1,len(sn)):.1f}")
