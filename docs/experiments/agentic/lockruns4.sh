#!/bin/bash
# Two engines and half the episodes a step (8 groups of 8): the agent path on seeds 1 and 0, each stopped
# once its training passed 605 s; from a worktree of the commit under test (PYTHONPATH), one at a time.
cd /tmp/wt-runs
export PYTHONPATH=/tmp/wt-runs
while pgrep -f "out /tmp/runs/dp2-agent-s0" > /dev/null; do sleep 5; done
run() { name=$1; shift; start=$SECONDS; timeout 900 /work/main/.venv/bin/molt-train --config recipes/locker.yaml --engine.data_parallel_size 2 "$@" --out /tmp/runs/$name > /tmp/runs/$name.log 2>&1; echo "$name rc $? wall $((SECONDS-start)) s" >> /tmp/runs/lockruns4.txt; }
run dp2-g8-agent-s1 --seed 1 --rollout.groups_per_step 8 --agent environments.agents:LockerAgent
run dp2-g8-agent-s0 --seed 0 --rollout.groups_per_step 8 --agent environments.agents:LockerAgent
