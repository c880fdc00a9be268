#!/bin/bash
# The pipeline of docs/sft.md on the default task: sample the base agent, keep its rewarded rollouts,
# molt-sft on them, then molt-train from the result. Usage: pipeline.sh OUT_ROOT SEED
set -e
root=$1; seed=${2:-0}
mkdir -p "$root"
# 1. the base agent's samples: one step of 128 groups x 8 (its rollouts are the untrained policy's)
molt-train --seed "$seed" --steps 1 --rollout.groups_per_step 128 --log.rollouts true --out "$root/sample"
# 2. supervised fine-tuning on the rewarded ones, the default task's held-out episodes played as it goes
molt-sft --seed "$seed" --data.path "$root/sample/rollouts" --data.min_reward 1 --epochs 4 \
  --data.batch_size 16 --train.lr 3e-3 --env digit --eval.every 5 --eval.at_start true --out "$root/sft"
# 3. RL from the fine-tuned policy
last=$(ls -d "$root"/sft/checkpoints/step_* | tail -1)
molt-train --seed "$seed" --model "$last/policy" --out "$root/rl"
