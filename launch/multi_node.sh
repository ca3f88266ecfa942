#!/usr/bin/env bash
# Several machines: run this once on every node, same arguments except NODE_RANK.
#   node 0: bash launch/multi_node.sh 2 0 10.0.0.1:29500 8 experiment=llama3_8b_tp2_cp2 data.input=/data/train.jsonl data.tokenizer=/models/llama3
#   node 1: bash launch/multi_node.sh 2 1 10.0.0.1:29500 8 experiment=llama3_8b_tp2_cp2 data.input=/data/train.jsonl data.tokenizer=/models/llama3
# Arguments: NNODES NODE_RANK RDZV_HOST:PORT NPROC_PER_NODE, then Hydra overrides.
# The backend is nccl when torch sees a GPU, else gloo (an explicit parallel.backend=... wins).
# checkpoint.save / train.output_dir must be on a filesystem every node sees.
set -euo pipefail
if [ $# -lt 4 ]; then
  echo "usage: launch/multi_node.sh NNODES NODE_RANK RDZV_HOST:PORT NPROC_PER_NODE [key=value ...]" >&2
  exit 2
fi
NNODES=$1 NODE_RANK=$2 RDZV=$3 NPROC=$4
shift 4
cd "$(dirname "$0")/.."
source launch/common.sh "$@"
exec "$PY" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --rdzv-backend c10d --rdzv-endpoint "$RDZV" --rdzv-id "${RDZV_ID:-megatron_pack}" \
  --nproc-per-node "$NPROC" -m megatron_pack.train "${BACKEND[@]}" "$@"
