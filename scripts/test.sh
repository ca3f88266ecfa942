#!/usr/bin/env bash
# Set up what is missing, then run the whole test suite (unit + functional, CPU only).
# PYTEST_WORKERS pytest-xdist workers (default 2, one per core of the CI machine) take whole modules, the longest
# first; each runs its worlds one case at a time on a pool of ranks started once (tests/conftest.py,
# tests/_dist.py). PYTEST_WORKERS=0 runs everything in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONHASHSEED=0 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
workers=${PYTEST_WORKERS:-2}
# Only the plugins the suite uses: pytest rewrites the asserts of every module of every installed plugin's
# distribution (hypothesis, hydra, anyio: 168 modules), in each worker, at every run (CI forbids the bytecode cache).
plugins=(--disable-plugin-autoload -p xdist.plugin -p pytest_timeout -p _hypothesis_pytestplugin)
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest "${plugins[@]}" tests/unit tests/functional "$@"
fi
exec .venv/bin/python -m pytest "${plugins[@]}" -n "$workers" --dist loadgroup tests/unit tests/functional "$@"
