# Sourced by the launch scripts; never changes directory, so relative paths in the overrides
# (data, tokenizer, output) resolve against the caller's folder. Sets:
#   REPO     the repository holding these scripts (prepended to PYTHONPATH, so its megatron_pack runs)
#   PY       the Python to run (PYTHON, else $REPO/.venv/bin/python, else python3)
#   BACKEND  an array holding the parallel.backend of the config "$@" loads (its train.device, a preset's
#            included, on this host: nccl for a run on a GPU, else gloo)
#            (with OMP_NUM_THREADS defaulting to 1); empty when the overrides "$@" already name one.
#            Decided without importing torch (megatron_pack.cli.launch backend: a CUDA or ROCm build
#            of torch and a visible GPU device node), so it costs no torch start-up.
# and defines check_config WORLD_SIZE [key=value ...]: `megatron_pack.train --check` as a run of
# WORLD_SIZE ranks, so a refused config prints once and the script exits 2 before torchrun starts.
# The scripts then exec `python -m megatron_pack.cli.launch torchrun ...`, which runs torchrun as its
# child: stop signals (SIGTERM, SIGUSR1, SIGUSR2) go to the workers, which save and exit 0, and no
# worker outlives the script, even after kill -9 (docs/launch.md, "Signals and preemption").
REPO=${MEGATRON_PACK_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-$([ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || command -v python3)}
BACKEND=()
if [[ " $* " != *" parallel.backend="* ]]; then
  if [ "$("$PY" -m megatron_pack.cli.launch backend "$@")" = nccl ]; then
    BACKEND=(parallel.backend=nccl)
  else
    BACKEND=(parallel.backend=gloo)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  fi
fi

check_config() {
  local world_size=$1
  shift
  # MEGATRON_PACK_CHECK_HOST=here: the run starts on this host, so its rules are checked for this host even when
  # the config names train.device=cuda (a plain `train --check` checks such a config for the GPU host it names)
  MEGATRON_PACK_CHECK_HOST=here WORLD_SIZE=$world_size RANK=0 LOCAL_RANK=0 "$PY" -m megatron_pack.train --check "$@" \
    >/dev/null || exit $?
}
