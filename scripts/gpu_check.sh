#!/usr/bin/env bash
# Run every GPU path of Molt that this machine can run, in minutes, and print a short report.
#
#   bash scripts/gpu_check.sh
#
# The checks are tests/gpu/ (each module says what it measures and its bounds):
#   - the dry run's trainer memory against torch.cuda.max_memory_allocated of real trainer steps (PolicyRank in
#     this process, no Ray): the tiny dense model in fp32 and in bf16 with full activation checkpointing, and a
#     Qwen3-0.6B-shaped model (molt-tiny --like recipes/models/qwen3-0.6b) in bf16 with full checkpointing and
#     chunked logprobs, whose `molt-train --dry-run` must say that it fits one 80 GB GPU; its step time too
#   - routing replay on the tiny MoE on CUDA: transformers' class, and NeMo AutoModel's where it imports
#   - vLLM's GPU engine against transformers: sampled-token logprobs, dense and MoE, fp32 and bf16; its routed
#     experts against the trainer's own top-k; a tied output head following a weight update; the plan's engine
#     weights against what vLLM loaded
#   - the bucketed NCCL weight sync with partial rollout (needs 2 GPUs: NCCL refuses two ranks on one)
#   - a 20-step `molt-train` on the default task, trainer and bf16 engine colocated on the one GPU
# Each prints PASS / FAIL / SKIP with its measured numbers; the script exits 1 if any failed.
#
# With a GPU (nvidia-smi sees one) it installs nothing from a network. Its Python is $PYTHON, else .venv's (a CUDA
# stack from `MOLT_DEVICE=cuda bash scripts/setup.sh`, with vLLM and Ray: every check runs), else python3. Where
# that Python lacks Molt, it installs the wheels carried in .whl/ and Molt from this working tree into a folder of
# its own (pip --no-index --no-deps --target) and uses the Python's own torch and transformers.
#
# The GPU machine this project may be lent (/work/.library/device/KINDS.md: python3 is Python 3.12 with torch
# 2.11 for CUDA 13, transformers 5.17, PEFT and pytest; one GPU; no network, no vLLM, no Ray) runs the trainer
# steps with the dry run and routing replay. vLLM's GPU engine, the molt-train run (vLLM and Ray) and the NCCL
# sync (2 GPUs) cannot run there: the script says so before the checks start, and each skips saying why. Here,
# once, fill .whl/ with what that machine lacks, then give the device tool this command with .whl carried:
#   bash scripts/gpu_wheels.sh                                   # jsonargparse and gymnasium, under 2 MiB
#   run: command "bash scripts/gpu_check.sh", carry [".whl"], timeout_s 600
# Time budget: under 8 minutes on one GPU is the aim.
#
# Without a GPU it installs nothing, runs the checks with the existing .venv (they skip, each with its reason)
# and ends with "no CUDA: skipped".
#
# Environment:
#   PYTHON=python3             the GPU branch's Python (it must hold torch with CUDA, transformers, peft, pytest)
#   MOLT_GPU_CHECK_FORCE=1     take the GPU branch without a GPU: a dry run of it, e.g. in a fresh virtual
#                              environment with only torch 2.11, transformers 5.17, peft and pytest and no network
#                              (`unshare -n`). The checks then run anyway (tests/gpu/conftest.py) and each fails at
#                              its first CUDA call; an ImportError or a missing package before that is a bug here.
#   MOLT_GPU_SITE=DIR          where the GPU branch installs the wheels and Molt (default /tmp/molt-gpu-site)
#   MOLT_GPU_TEST_TIMEOUT=S    per-test timeout in seconds (default 240)
#   MOLT_GPU_REPORT=FILE       where the checks' JSON goes (default runs/gpu_check/report.json)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$SECONDS

gpus=$(nvidia-smi -L 2>/dev/null) || gpus=""
if [[ -n $gpus || ${MOLT_GPU_CHECK_FORCE:-0} == 1 ]]; then
  export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}  # the models are built here: no hub lookup waits on a network
  python=${PYTHON:-python3}
  [[ -z ${PYTHON:-} && -x .venv/bin/python ]] && python=.venv/bin/python  # a CUDA stack from scripts/setup.sh
  if [[ -n $gpus ]]; then
    echo "gpu_check: $(head -1 <<<"$gpus"), $(wc -l <<<"$gpus") GPU(s)"
  else
    echo "gpu_check: no GPU, GPU branch forced (MOLT_GPU_CHECK_FORCE=1): each check should fail at its first CUDA call"
  fi
  if "$python" -c "import importlib.metadata as m, jsonargparse, gymnasium; m.distribution('molt')" 2>/dev/null; then
    echo "gpu_check: $python holds Molt and what the checks import: nothing installed"
  else
    site=${MOLT_GPU_SITE:-/tmp/molt-gpu-site}
    rm -rf "$site"
    install=("$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site")
    shopt -s nullglob
    wheels=(.whl/*.whl)
    if ((${#wheels[@]})); then
      "${install[@]}" "${wheels[@]}" || { echo "gpu_check: installing .whl/ failed" >&2; exit 1; }
    else
      echo "gpu_check: no wheels in .whl/ (run scripts/gpu_wheels.sh and carry .whl): the dry-run checks will fail"
    fi
    # Molt from this working tree, with the machine's setuptools (its entry points name the bundled environments).
    [[ -e build ]] && kept_build=1 || kept_build=0
    if ! built=$("${install[@]}" --no-build-isolation . 2>&1); then
      echo "$built" >&2
      echo "gpu_check: installing Molt from $PWD failed" >&2
      exit 1
    fi
    ((kept_build)) || rm -rf build  # setuptools' build folder, written by the line above
    export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    echo "gpu_check: installed ${#wheels[@]} carried wheel(s) and Molt from this tree into $site"
  fi
  "$python" -c "import sys, torch, transformers, peft
print(f'gpu_check: Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), '
      f'transformers {transformers.__version__}, peft {peft.__version__}')" || exit 1
  if [[ -n $gpus ]] && ! "$python" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check: nvidia-smi sees a GPU but $python's torch does not (torch.cuda.is_available() is False)" >&2
    exit 1
  fi
  "$python" - <<'EOF'
import importlib.util
import torch

missing = {name for name in ("vllm", "ray", "nemo_automodel") if importlib.util.find_spec(name) is None}
cannot = []
if "vllm" in missing:
    cannot.append("vLLM's GPU engine (logprobs, routed experts, tied head, engine weights): no vllm here")
if missing & {"vllm", "ray"}:
    cannot.append("the 20-step molt-train run on one GPU: needs vLLM and Ray; no " +
                  " and no ".join(sorted(missing & {"vllm", "ray"})) + " here")
if torch.cuda.device_count() < 2:
    cannot.append(f"the NCCL weight sync: needs 2 GPUs (NCCL refuses two ranks on one GPU), "
                  f"{torch.cuda.device_count()} here")
if "nemo_automodel" in missing:
    cannot.append("routing replay in NeMo AutoModel's own MoE class: no nemo_automodel here")
if cannot:
    print("gpu_check: cannot run on this machine, do not wait for these (each is reported SKIP):")
    print("\n".join(f"  - {line}" for line in cannot))
EOF
else
  echo "gpu_check: no GPU (nvidia-smi finds none): nothing installed, the checks run with the existing .venv"
  [[ -x .venv/bin/python ]] || { echo "gpu_check: no .venv; run scripts/setup.sh first" >&2; exit 1; }
  python=.venv/bin/python
fi

report=${MOLT_GPU_REPORT:-runs/gpu_check/report.json}
mkdir -p "$(dirname "$report")"
rm -f "$report"
# -o addopts= drops the suite's --durations; -p no:cacheprovider leaves no .pytest_cache behind.
MOLT_GPU_REPORT=$report OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} \
  "$python" -m pytest tests/gpu -q -rs -s -o addopts= -p no:cacheprovider \
  --timeout "${MOLT_GPU_TEST_TIMEOUT:-240}"
tests=$?

echo "---- gpu_check report ($((SECONDS - start)) s) ----"
"$python" tests/gpu/report.py "$report"
shown=$?
# pytest: 0 all passed or skipped, 5 nothing collected; anything else is a failure.
if [[ $tests -ne 0 || $shown -ne 0 ]]; then
  exit 1
fi
