#!/usr/bin/env bash
# Create (or reuse) .venv and install megatron_pack with its test extra. Idempotent: a second run
# with an unchanged setup.py installs nothing. torch==2.13.0 (a CPU wheel on this machine class)
# is installed first, so no other requirement can pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing torch==2.13.0"
  "$VPY" -m pip install -q torch==2.13.0
fi
stamp=.venv/.megatron_pack.stamp
want=$(cat setup.py | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$VPY" -c "import megatron_pack, megatron.core, hypothesis" >/dev/null 2>&1; then
  echo "[setup] installing megatron_pack[test] (editable)"
  "$VPY" -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi
echo "[setup] ready: $("$VPY" -c 'import torch, megatron.core; print("torch", torch.__version__, "megatron-core", megatron.core.__version__)' 2>/dev/null)"
