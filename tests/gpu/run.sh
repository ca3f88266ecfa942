#!/usr/bin/env bash
# Every GPU check of the project in one call, printing one table (tests/gpu/checks.py lists them).
#
#   bash tests/gpu/run.sh                 # python3 on PATH (the GPU machine's, with torch)
#   PYTHON=.venv/bin/python bash tests/gpu/run.sh
#
# On a machine with one GPU and only torch installed: wheels carried in .whl/ (made here by
# tests/gpu/download_wheels.sh; the folder is gitignored) are installed into a private folder
# (--no-index: no network), megatron_pack is read from this working tree, then each check runs in
# its own process with its own timeout (535 s at most together, under 10 minutes with the install). Without
# CUDA every check is skipped, each with a "SKIP <check>: ..." line, and the status is 0 (CI runs it so:
# tests/unit/test_gpu_run_script.py).
# Exit status: 0 when no check failed, 1 when one did, 2 when the install failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
SITE=${MEGATRON_PACK_GPU_SITE:-/tmp/megatron_pack_gpu_site}
WHEELS=${MEGATRON_PACK_GPU_WHEELS:-.whl}
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
if ((${#wheels[@]})); then
  echo "[run.sh] installing ${#wheels[@]} carried wheel(s) from $WHEELS/ into $SITE (no network)"
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"; then
    echo "[run.sh] installing the wheels in $WHEELS/ failed (made for another Python?); re-make them with" \
         "PY_VERSION=<this python's X.Y> bash tests/gpu/download_wheels.sh" >&2
    exit 2
  fi
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "[run.sh] no wheels in $WHEELS/: using what $PY already has (tests/gpu/download_wheels.sh makes them)"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# what prepare, train, verify and export import (tests/gpu/preflight.py), before any check runs
"$PY" tests/gpu/preflight.py || exit 2
exec "$PY" tests/gpu/checks.py
