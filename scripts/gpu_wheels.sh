#!/usr/bin/env bash
# Fill a folder with the wheels that scripts/gpu_check.sh needs on the lent GPU machine, and print their size.
#
#   bash scripts/gpu_wheels.sh [DIR]      (default DIR: .whl, ignored by git)
#
# That machine reaches no network. Its Python 3.12 holds torch 2.11 (CUDA 13), transformers, PEFT, numpy,
# safetensors, tokenizers, pytest and pytest-timeout (/work/.library/device/KINDS.md lists them), but not the
# pure-Python packages that `molt-train --dry-run` imports: jsonargparse with its signatures extra, and
# Gymnasium (the environment registry). This downloads exactly those, at the versions of the CPU stack's
# .venv, for Python 3.12. Molt itself does not travel as a wheel: gpu_check.sh installs it there from the
# working tree, which travels anyway.
#
# A device call may carry 64 MiB in all: these wheels (under 1 MiB) and the working tree together.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dir=${1:-.whl}

WHEELS=(
  jsonargparse==4.53.0
  docstring_parser==0.18.0      # jsonargparse[signatures]: flag help from the config's docstrings
  typeshed_client==2.15.0       # jsonargparse[signatures]
  gymnasium==1.4.0
  farama_notifications==0.0.6   # gymnasium
)

python=${PYTHON:-python3}
rm -rf "$dir"
mkdir -p "$dir"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$dir" "${WHEELS[@]}"
ls -1 "$dir"
echo "gpu_wheels: $(find "$dir" -type f -name '*.whl' | wc -l) wheels in $dir, $(du -sh "$dir" | cut -f1) together;" \
     "the tracked tree is $(git ls-files -z | du -ch --files0-from=- | tail -1 | cut -f1) (64 MiB at most travel)"
