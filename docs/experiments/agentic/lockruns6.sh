#!/bin/bash
# The recipe with a learning-rate warmup (--train.warmup_steps 30) on two engines: the agent path on seeds 1
# and 0 (each stopped once its training passed 605 s), then the env runner and the blank control on both
# seeds; from a worktree of the commit under test (PYTHONPATH), one at a time.
cd /tmp/wt-runs
export PYTHONPATH=/tmp/wt-runs
while pgrep -f "seeds.sh" > /dev/null; do sleep 5; done
run() { name=$1; shift; start=$SECONDS; timeout 900 /work/main/.venv/bin/molt-train --config recipes/locker.yaml --engine.data_parallel_size 2 --train.warmup_steps 30 "$@" --out /tmp/runs/$name > /tmp/runs/$name.log 2>&1; echo "$name rc $? wall $((SECONDS-start)) s" >> /tmp/runs/lockruns6.txt; }
run wu30-agent-s1 --seed 1 --agent environments.agents:LockerAgent
run wu30-agent-s0 --seed 0 --agent environments.agents:LockerAgent
run wu30-s0 --seed 0
run wu30-s1 --seed 1
run wu30-blank-s0 --seed 0 --env environments.locker:BlankLocker
run wu30-blank-s1 --seed 1 --env environments.locker:BlankLocker
