#!/usr/bin/env bash
# The README's first command: set up .venv, prepare the embedded synthetic SFT set, then train the
# tiny model for 50 steps with context parallelism 2 on 2 CPU processes (torchrun, gloo).
# A few minutes on 2 cores. Idempotent: a re-run reuses .venv and the prepared dataset, and
# resumes from the last checkpoint (a finished run only prints its summary again).
# Extra key=value arguments go to both prepare and train, e.g. a smoke run:
#   bash scripts/quickstart.sh train.train_iters=3 train.output_dir=/tmp/qs data.dataset_dir=/tmp/qs/data
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONHASHSEED=0
echo "[quickstart] megatron-pack prepare experiment=quickstart $*"
.venv/bin/megatron-pack prepare experiment=quickstart "$@"
echo "[quickstart] torchrun --nproc-per-node 2 megatron_pack.train experiment=quickstart $*"
bash launch/single_node.sh 2 experiment=quickstart "$@"
