#!/bin/bash
# lockruns8.sh's configuration (warmup 30, zero-variance filter, two engines) for the env runner on seeds 0
# and 1 and the blank control on seed 0 (the recipe's 500 steps), then the agent path on seed 2 (stopped
# once its training passed 605 s); from a worktree of the commit under test (PYTHONPATH), one at a time.
cd /tmp/wt-runs
export PYTHONPATH=/tmp/wt-runs
run() { name=$1; shift; start=$SECONDS; timeout 900 /work/main/.venv/bin/molt-train --config recipes/locker.yaml --engine.data_parallel_size 2 --train.warmup_steps 30 --algo.filter_zero_variance true "$@" --out /tmp/runs/$name > /tmp/runs/$name.log 2>&1; echo "$name rc $? wall $((SECONDS-start)) s" >> /tmp/runs/lockruns9.txt; }
run fzv-s0 --seed 0
run fzv-s1 --seed 1
run fzv-blank-s0 --seed 0 --env environments.locker:BlankLocker
run fzv-agent-s2 --seed 2 --agent environments.agents:LockerAgent
