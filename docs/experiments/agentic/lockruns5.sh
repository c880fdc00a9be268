#!/bin/bash
# Half the episodes a step (8 groups of 8) for 800 steps on two engines: the agent path on seeds 1 and 0,
# each stopped once its training passed 605 s; from a worktree of the commit under test (PYTHONPATH).
cd /tmp/wt-runs
export PYTHONPATH=/tmp/wt-runs
run() { name=$1; shift; start=$SECONDS; timeout 900 /work/main/.venv/bin/molt-train --config recipes/locker.yaml --engine.data_parallel_size 2 --rollout.groups_per_step 8 --steps 800 "$@" --out /tmp/runs/$name > /tmp/runs/$name.log 2>&1; echo "$name rc $? wall $((SECONDS-start)) s" >> /tmp/runs/lockruns5.txt; }
run g8x800-agent-s1 --seed 1 --agent environments.agents:LockerAgent
run g8x800-agent-s0 --seed 0 --agent environments.agents:LockerAgent
