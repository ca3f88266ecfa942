#!/usr/bin/env bash
# Set up what is missing, then run the whole test suite (unit + functional, CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONHASHSEED=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest tests/unit tests/functional "$@"
