#!/bin/bash
# The warmup of lockruns6.sh plus DAPO's filter of groups whose rewards are all equal
# (--algo.filter_zero_variance: they carry no advantage, so the trainer skips their tokens), two engines:
# the agent path on seeds 1 and 0 (each stopped once its training passed 605 s), then the env runner and
# the blank control; from a worktree of the commit under test (PYTHONPATH), one at a time.
cd /tmp/wt-runs
export PYTHONPATH=/tmp/wt-runs
run() { name=$1; shift; start=$SECONDS; timeout 900 /work/main/.venv/bin/molt-train --config recipes/locker.yaml --engine.data_parallel_size 2 --train.warmup_steps 30 --algo.filter_zero_variance true "$@" --out /tmp/runs/$name > /tmp/runs/$name.log 2>&1; echo "$name rc $? wall $((SECONDS-start)) s" >> /tmp/runs/lockruns8.txt; }
run fzv-agent-s1 --seed 1 --agent environments.agents:LockerAgent
run fzv-agent-s0 --seed 0 --agent environments.agents:LockerAgent
run fzv-s0 --seed 0
run fzv-s1 --seed 1
run fzv-blank-s0 --seed 0 --env environments.locker:BlankLocker
