#!/usr/bin/env bash
# Creates the isolated venv that `edge-agent model build --target rknn:<soc>` converts in.
#   scripts/setup_rknn_converter.sh [VENV_DIR]
# VENV_DIR defaults to /opt/edge-agent/rknn-venv (beside a device install, as root); in a
# checkout pass .rknn-venv (git ignores it). The agent finds the venv's python through the
# config key model_build.rknn_python, else EDGE_AGENT_RKNN_PYTHON, else
# /opt/edge-agent/rknn-venv/bin/python.
# Why a venv of its own: rknn-toolkit2 pins numpy<=1.26.4, onnx<=1.18, protobuf<=4.25.4
# and torch<=2.4.0, none of which may enter the agent's venv; the agent runs it as a
# subprocess. The pinned set installs on x86_64 and aarch64 Linux with CPython 3.9-3.12
# (numpy 1.26 and onnx 1.18 start at 3.9; the toolkit has no 3.13 build).
# PYTHON=... picks the interpreter (default python3). torch comes from PyPI, a CUDA build of
# about 2.5 GB with its libraries. Idempotent: a second run changes nothing.

set -euo pipefail

venv="${1:-/opt/edge-agent/rknn-venv}"
python="${PYTHON:-python3}"

# The toolkit's own caps, pinned to the versions this was tested with; opencv-python 4.12+
# needs numpy 2, which the toolkit cannot take.
packages=(
    "rknn-toolkit2==2.5.0"
    "torch==2.4.0"
    "numpy==1.26.4"
    "onnx==1.18.0"
    "protobuf==4.25.4"
    "opencv-python==4.11.0.86"
)

step() {
    echo "setup_rknn_converter.sh: $*"
}

if ! "$python" -c 'import sys; sys.exit(not ((3, 9) <= sys.version_info[:2] <= (3, 12)))'; then
    found="$("$python" -V 2>&1 || true)"
    echo "setup_rknn_converter.sh: $python is ${found:-no working python}; rknn-toolkit2 2.5.0" \
         "with its pins needs CPython 3.9-3.12 (set PYTHON=python3.X)" >&2
    exit 2
fi

mkdir -p "$(dirname "$venv")"
venv="$(cd "$(dirname "$venv")" && pwd)/$(basename "$venv")"  # absolute: the agent is elsewhere
if [ ! -x "$venv/bin/python" ]; then
    step "creating $venv with $("$python" -V 2>&1)"
    "$python" -m venv "$venv"
fi
step "installing ${packages[*]} (torch is about 2.5 GB the first time)"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "${packages[@]}"
check='import importlib.metadata as m, rknn.api; print(m.version("rknn-toolkit2"))'
if ! version="$("$venv/bin/python" -c "$check" 2>/dev/null | tail -n 1)"; then
    echo "setup_rknn_converter.sh: rknn.api does not import in $venv; see" \
         "$venv/bin/python -c 'import rknn.api'" >&2
    exit 1
fi
step "rknn-toolkit2 $version ready; the agent uses $venv/bin/python"
step "(config model_build.rknn_python or EDGE_AGENT_RKNN_PYTHON=$venv/bin/python)"
