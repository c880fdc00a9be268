#!/bin/bash
# The rest of lockruns6.sh: the env runner with the 30-step warmup on two engines, seeds 0 and 1.
cd /tmp/wt-runs
export PYTHONPATH=/tmp/wt-runs
run() { name=$1; shift; start=$SECONDS; timeout 900 /work/main/.venv/bin/molt-train --config recipes/locker.yaml --engine.data_parallel_size 2 --train.warmup_steps 30 "$@" --out /tmp/runs/$name > /tmp/runs/$name.log 2>&1; echo "$name rc $? wall $((SECONDS-start)) s" >> /tmp/runs/lockruns7.txt; }
run wu30-s0 --seed 0
run wu30-s1 --seed 1
