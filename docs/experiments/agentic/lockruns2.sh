#!/bin/bash
# the recipe with kl 0.3: runner seeds 0 1, agent seed 0, blank control seeds 0 1 (agent seed 1 ran as locker-agent-kl03-s1)
cd /work/main
while pgrep -f "locker-agent-kl03-s1" > /dev/null; do sleep 5; done
run() { name=$1; shift; start=$SECONDS; .venv/bin/molt-train --config recipes/locker.yaml "$@" --out /tmp/runs/$name > /tmp/runs/$name.log 2>&1; echo "$name rc $? wall $((SECONDS-start)) s" >> /tmp/runs/lockruns2.txt; }
run kl03-s0 --seed 0
run kl03-s1 --seed 1
run kl03-agent-s0 --seed 0 --agent environments.agents:LockerAgent
run kl03-blank-s0 --seed 0 --env environments.locker:BlankLocker
run kl03-blank-s1 --seed 1 --env environments.locker:BlankLocker
