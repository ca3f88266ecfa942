#!/usr/bin/env bash
# Create (or reuse) .venv and install megatron_pack with its test extra. Idempotent: a second run
# with an unchanged setup.py installs nothing. torch==2.13.0 (a CPU wheel on this machine class)
# is installed first, so no other requirement can pull a multi-GB CUDA build.
#
# The installs go through uv (installed into .venv from PyPI) when it can: it installs the same packages as pip
# from the same wheels in half the CPU time (it unpacks and byte-compiles on every core; pip on one). Installs
# are byte-compiled (--compile-bytecode, as pip does): with PYTHONDONTWRITEBYTECODE set, as on the CI machines,
# every process of the tests would otherwise compile torch again when it imports it. uv reads pip's find-links and constraint settings from the environment
# or pip's config, as pip does; if uv cannot be had or fails, pip installs instead (MEGATRON_PACK_SETUP_PIP=1
# forces pip).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1

pip_setting() {  # the environment's PIP_<NAME>, else pip's config value global.<name> (empty if neither)
  local env_name="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
  if [ -n "${!env_name:-}" ]; then echo "${!env_name}"; else "$VPY" -m pip config get "global.$1" 2>/dev/null || true; fi
}

install() {  # install "$@" into .venv: uv if it works, else pip
  if [ "${MEGATRON_PACK_SETUP_PIP:-0}" != 1 ]; then
    if [ ! -x .venv/bin/uv ]; then "$VPY" -m pip install -q uv >/dev/null 2>&1 || true; fi
    if [ -x .venv/bin/uv ]; then
      local args=() links constraint
      links=$(pip_setting find-links); constraint=$(pip_setting constraint)
      for link in $links; do args+=(--find-links "$link"); done
      for file in $constraint; do [ -f "$file" ] && args+=(--constraint "$file"); done
      if .venv/bin/uv pip install -q --compile-bytecode --python "$VPY" "${args[@]}" "$@"; then return 0; fi
      echo "[setup] uv failed; installing with pip"
    fi
  fi
  "$VPY" -m pip install -q "$@"
}

installed() {  # every module named is installed (found, not imported: importing torch and megatron-core takes 8 s)
  "$VPY" -c 'import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))' "$@" \
    >/dev/null 2>&1
}

if ! installed torch; then
  echo "[setup] installing torch==2.13.0"
  install torch==2.13.0
fi
stamp=.venv/.megatron_pack.stamp
want=$(cat setup.py | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! installed megatron_pack megatron.core hypothesis; then
  echo "[setup] installing megatron_pack[test] (editable)"
  install -e ".[test]"
  echo "$want" > "$stamp"
fi
echo "[setup] ready: $("$VPY" -c 'from importlib.metadata import version as v; print("torch", v("torch"), "megatron-core", v("megatron-core"))' 2>/dev/null)"
