#!/usr/bin/env bash
# Several machines: run this once on every node, same arguments except NODE_RANK.
#   node 0 (10.0.0.1): bash launch/multi_node.sh 2 0 10.0.0.1:29500 8 experiment=llama3_8b_tp2_cp2 data.input=/data/train.jsonl data.tokenizer=/models/llama3
#   node 1:            bash launch/multi_node.sh 2 1 10.0.0.1:29500 8 experiment=llama3_8b_tp2_cp2 data.input=/data/train.jsonl data.tokenizer=/models/llama3
# Arguments: NNODES NODE_RANK MASTER_HOST:PORT NPROC_PER_NODE, then Hydra overrides.
# Ranks are deterministic (torchrun's static rendezvous): node NODE_RANK holds global ranks
# NODE_RANK*NPROC_PER_NODE .. +NPROC_PER_NODE-1, so node 0 (which must run on MASTER_HOST) holds
# rank 0 and writes the metrics and checkpoint metadata.
# The backend is nccl when torch sees a GPU (unless train.device=cpu), else gloo (an explicit parallel.backend=... wins).
# Relative paths resolve against the folder you run it from; checkpoint.save / train.output_dir
# must be on a filesystem every node sees. A refused config prints once per node, exit 2.
set -euo pipefail
if [ $# -lt 4 ]; then
  echo "usage: launch/multi_node.sh NNODES NODE_RANK MASTER_HOST:PORT NPROC_PER_NODE [key=value ...]" >&2
  exit 2
fi
NNODES=$1 NODE_RANK=$2 MASTER=$3 NPROC=$4
shift 4
if [[ "$MASTER" != *:* ]]; then
  echo "launch/multi_node.sh: MASTER_HOST:PORT ($MASTER) needs a port, e.g. $MASTER:29500" >&2
  exit 2
fi
source "$(dirname "${BASH_SOURCE[0]}")/common.sh" "$@"
check_config "$((NNODES * NPROC))" "${BACKEND[@]}" "$@"
exec "$PY" -m megatron_pack.cli.launch torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "${MASTER%:*}" --master-port "${MASTER##*:}" \
  --nproc-per-node "$NPROC" -m megatron_pack.train "${BACKEND[@]}" "$@"
