#!/usr/bin/env bash
# One machine: torchrun --nproc-per-node N, Hydra overrides passed through to `megatron_pack.train`.
#   bash launch/single_node.sh 2 experiment=quickstart                  # 2 CPU processes (gloo), CP=2
#   bash launch/single_node.sh 8 experiment=llama3_8b_tp2_cp2 data.input=/data/train.jsonl data.tokenizer=/models/llama3
# The backend is nccl when torch sees a GPU (unless train.device=cpu), else gloo (an explicit parallel.backend=... wins).
# Relative paths resolve against the folder you run it from. A refused config prints once, exit 2.
set -euo pipefail
NPROC=${1:?usage: launch/single_node.sh NPROC_PER_NODE [key=value ...]}
shift
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"
check_config "$NPROC" "${BACKEND[@]}" "$@"
exec "$PY" -m megatron_pack.cli.launch torchrun --standalone --nproc-per-node "$NPROC" \
  -m megatron_pack.train "${BACKEND[@]}" "$@"
