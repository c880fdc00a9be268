#!/bin/bash
# the default run on seeds 0..9, one after another
cd /work/main
for s in 0 1 2 3 4 5 6 7 8 9; do
  start=$SECONDS
  .venv/bin/molt-train --seed $s --out /tmp/runs/default-$s > /tmp/runs/default-$s.log 2>&1
  rc=$?
  .venv/bin/python - $s $rc $((SECONDS-start)) <<'PY'
import json, sys
s, rc, wall = sys.argv[1:]
r = [json.loads(l)["reward/mean"] for l in open(f"/tmp/runs/default-{s}/metrics.jsonl") if l.strip()]
print(f"seed {s}: rc {rc}, {len(r)} steps, first5 {sum(r[:5])/5:.3f} -> last5 {sum(r[-5:])/5:.3f}, wall {wall} s", flush=True)
PY
done
