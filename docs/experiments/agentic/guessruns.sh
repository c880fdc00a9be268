#!/bin/bash
cd /work/main
run() { name=$1; shift; start=$SECONDS; .venv/bin/molt-train "$@" --out /tmp/runs/$name > /tmp/runs/$name.log 2>&1; echo "$name rc $? wall $((SECONDS-start)) s" >> /tmp/runs/guessruns.txt; }
run told-s0 --config recipes/guess_number_told.yaml --seed 0
run told-s1 --config recipes/guess_number_told.yaml --seed 1
run nohint-s0 --config recipes/guess_number_told.yaml --seed 0 --env environments.guess_number:GuessNumberNoFeedback
run nohint-s1 --config recipes/guess_number_told.yaml --seed 1 --env environments.guess_number:GuessNumberNoFeedback
