#!/bin/bash
cd /work/main
while pgrep -f lockruns2.sh > /dev/null; do sleep 5; done
for s in 0 1 2 3 4 5 6 7 8 9; do
  start=$SECONDS
  .venv/bin/molt-train --seed $s --out /tmp/runs/final-default-$s > /tmp/runs/final-default-$s.log 2>&1
  rc=$?
  .venv/bin/python - $s $rc $((SECONDS-start)) <<'PY'
import json, sys
s, rc, wall = sys.argv[1:]
r = [json.loads(l)["reward/mean"] for l in open(f"/tmp/runs/final-default-{s}/metrics.jsonl") if l.strip()]
print(f"seed {s}: rc {rc}, {len(r)} steps, first5 {sum(r[:5])/5:.3f} -> last5 {sum(r[-5:])/5:.3f}, wall {wall} s", flush=True)
PY
done
