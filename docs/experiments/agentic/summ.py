import json, sys
for d in sys.argv[1:]:
    rows = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if l.strip()]
    r = [x["reward/mean"] for x in rows]; n = len(r)
    keys = ["reward/mean", "env/called", "env/right_id", "env/read_result", "response_len/mean"]
    w = max(1, n // 8)
    print(f"{d}: {n} steps, first10 {sum(r[:10])/min(10,n):.3f} -> last10 {sum(r[-10:])/min(10,n):.3f}  (t={rows[-1].get('time/elapsed', '?')})")
    for k in keys:
        if k in rows[0]:
            print(f"  {k:18s}", " ".join(f"{sum(x[k] for x in rows[i:i+w])/len(rows[i:i+w]):.2f}" for i in range(0, n, w)))
