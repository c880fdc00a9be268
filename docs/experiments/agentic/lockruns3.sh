#!/bin/bash
# The recipe with two engines (--engine.data_parallel_size 2): the agent path on seeds 1 and 0, then the
# env runner and the blank control, from a worktree of the commit under test (PYTHONPATH), one at a time.
cd /tmp/wt-runs
export PYTHONPATH=/tmp/wt-runs
run() { name=$1; shift; start=$SECONDS; timeout 900 /work/main/.venv/bin/molt-train --config recipes/locker.yaml --engine.data_parallel_size 2 "$@" --out /tmp/runs/$name > /tmp/runs/$name.log 2>&1; echo "$name rc $? wall $((SECONDS-start)) s" >> /tmp/runs/lockruns3.txt; }
run dp2-agent-s1 --seed 1 --agent environments.agents:LockerAgent
run dp2-agent-s0 --seed 0 --agent environments.agents:LockerAgent
run dp2-s0 --seed 0
run dp2-s1 --seed 1
run dp2-blank-s0 --seed 0 --env environments.locker:BlankLocker
run dp2-blank-s1 --seed 1 --env environments.locker:BlankLocker
