#!/usr/bin/env bash
# Set up TRL's side of the benchmark in bench/.venv-trl/ (created or reused), CPU only.
#
# A venv of its own: TRL and Molt pin different stacks, and the TRL side must
# not import Molt. The order matters, as in scripts/setup.sh: torch is pinned
# first (an unpinned torch resolved by pip pulls a multi-GB CUDA build), then
# TRL and the transformers of Molt's .venv, held to that torch.
#
# Re-running is cheap: a stamp of this script skips the install when nothing
# changed.
#
# Environment:
#   PYTHON=python3.11      interpreter for a new bench/.venv-trl (default: python3)
#   MOLT_TORCH_INDEX=URL   extra index for the torch wheel, e.g.
#                          https://download.pytorch.org/whl/cpu on a machine
#                          whose pip has no local CPU wheel of torch
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

TORCH_VERSION=2.13.0
TRL_VERSION=1.16.0
TRANSFORMERS_VERSION=5.19.0  # the same as Molt's .venv

venv=.venv-trl
stamp=$(sha256sum setup_trl.sh | cut -c1-16)
if [[ -f $venv/.trl-setup && "$(cat $venv/.trl-setup)" == "$stamp" ]] \
    && $venv/bin/python -c "import trl" >/dev/null 2>&1; then
  echo "setup_trl: bench/$venv is up to date"
  exit 0
fi

start=$SECONDS
echo "setup_trl: installing into bench/$venv"
[[ -x $venv/bin/python ]] || "${PYTHON:-python3}" -m venv $venv
pip=($venv/bin/python -m pip --disable-pip-version-check)

# Every later step is held to this torch.
constraints=$venv/trl-constraints.txt
echo "torch==$TORCH_VERSION" > "$constraints"
torch_index=()
[[ -n "${MOLT_TORCH_INDEX:-}" ]] && torch_index=(--extra-index-url "$MOLT_TORCH_INDEX")

echo "setup_trl: [1/2] torch $TORCH_VERSION"
"${pip[@]}" install -q "${torch_index[@]}" "torch==$TORCH_VERSION"
if $venv/bin/python -c "import torch, sys; sys.exit(torch.version.cuda is None)" 2>/dev/null; then
  echo "setup_trl: pip chose a CUDA build of torch; set MOLT_TORCH_INDEX=https://download.pytorch.org/whl/cpu" >&2
  exit 1
fi

echo "setup_trl: [2/2] trl $TRL_VERSION, transformers $TRANSFORMERS_VERSION"
"${pip[@]}" install -q -c "$constraints" "trl==$TRL_VERSION" "transformers==$TRANSFORMERS_VERSION"

if ! $venv/bin/python -c "import torch, transformers, trl; print(f'setup_trl: ok: torch {torch.__version__}, \
transformers {transformers.__version__}, trl {trl.__version__}')"; then
  echo "setup_trl: the installed stack does not import (see above)" >&2
  exit 1
fi
echo "$stamp" > $venv/.trl-setup
echo "setup_trl: done in $((SECONDS - start)) s"
