#!/bin/bash
# locker with a guess paying nothing (the reward needs a lookup of the asked locker); lockruns8.sh's flags
# (two engines, warmup 30, zero-variance filter); each run stopped once its training passed 605 s.
cd /tmp/wt-runs
export PYTHONPATH=/tmp/wt-runs
run() { name=$1; shift; start=$SECONDS; timeout 900 /work/main/.venv/bin/molt-train --config recipes/locker.yaml --steps 3000 --engine.data_parallel_size 2 --train.warmup_steps 30 --algo.filter_zero_variance true "$@" --out /tmp/runs10/$name > /tmp/runs10/$name.log 2>&1; echo "$name rc $? wall $((SECONDS-start)) s" >> /tmp/runs10/lockruns10.txt; }
run agent-s0 --seed 0 --agent environments.agents:LockerAgent
run runner-s0 --seed 0
run agent-s1 --seed 1 --agent environments.agents:LockerAgent
run runner-s1 --seed 1
run blank-s0 --seed 0 --env environments.locker:BlankLocker
