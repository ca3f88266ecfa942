# Sourced by the launch scripts (run from the repository root). Sets:
#   PY       the Python to run (PYTHON, else .venv/bin/python, else python3)
#   BACKEND  an array holding parallel.backend=nccl when torch sees a GPU, else parallel.backend=gloo
#            (with OMP_NUM_THREADS defaulting to 1); empty when the overrides "$@" already name one.
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || command -v python3)}
BACKEND=()
if [[ " $* " != *" parallel.backend="* ]]; then
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    BACKEND=(parallel.backend=nccl)
  else
    BACKEND=(parallel.backend=gloo)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  fi
fi
