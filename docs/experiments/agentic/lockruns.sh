#!/bin/bash
# locker runs, one after another: runner seeds 0 1, agent seeds 0 1, blank control seeds 0 1
cd /work/main
run() { name=$1; shift; start=$SECONDS; .venv/bin/molt-train --config recipes/locker.yaml "$@" --out /tmp/runs/$name > /tmp/runs/$name.log 2>&1; echo "$name rc $? wall $((SECONDS-start)) s" >> /tmp/runs/lockruns.txt; }
run locker-s0 --seed 0
run locker-s1 --seed 1
run locker-agent-s0 --seed 0 --agent environments.agents:LockerAgent
run locker-agent-s1 --seed 1 --agent environments.agents:LockerAgent
run blank-s0 --seed 0 --env environments.locker:BlankLocker
run blank-s1 --seed 1 --env environments.locker:BlankLocker
