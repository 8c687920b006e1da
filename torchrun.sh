#!/usr/bin/env bash
# Launch training on one node or many. Every node runs this script; node 0 also starts the Ray head and drives.
#
#   ./torchrun.sh --config configs/qwen3_30b_a3b.py                 # one node, all its GPUs
#   NNODES=64 NODE_RANK=$i MASTER_ADDR=node0 ./torchrun.sh --config configs/moe_700b.py   # on each node i
#
# Environment (all optional on one node):
#   NNODES         number of trainer nodes (default 1)
#   NODE_RANK      this node's rank among them (default 0)
#   MASTER_ADDR    address of node 0 (default 127.0.0.1); MASTER_PORT (default 29500)
#   NPROC_PER_NODE GPUs per node (default: all visible GPUs, or 1 on a CPU machine)
#   RAY_PORT       Ray head port on node 0 (default 6379)
#   ROLLOUT_NODE=1 this node only joins Ray as a rollout (vLLM engine) node and runs no trainer rank
#
# Slurm example (sbatch file), trainer nodes and rollout nodes in one allocation:
#   #SBATCH --nodes=80 --gpus-per-node=8 --ntasks-per-node=1
#   head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
#   srun bash -c 'if [ $SLURM_NODEID -lt 64 ]; then
#                   NNODES=64 NODE_RANK=$SLURM_NODEID MASTER_ADDR='"$head"' ./torchrun.sh --config configs/moe_700b.py
#                 else ROLLOUT_NODE=1 MASTER_ADDR='"$head"' ./torchrun.sh; fi'
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RAY_PORT=${RAY_PORT:-6379}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$($PY -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi

# Ray: the head on node 0, workers elsewhere; the driver (trainer rank 0) joins with address="auto"
if [ "$NNODES" -gt 1 ] || [ "${ROLLOUT_NODE:-0}" = 1 ]; then
  if [ "$NODE_RANK" = 0 ] && [ "${ROLLOUT_NODE:-0}" != 1 ]; then
    $PY -m ray.scripts.scripts start --head --port="$RAY_PORT" --disable-usage-stats
  else
    sleep 10  # let the head come up
    $PY -m ray.scripts.scripts start --address="$MASTER_ADDR:$RAY_PORT" --disable-usage-stats
  fi
  export RAY_ADDRESS=auto
fi
if [ "${ROLLOUT_NODE:-0}" = 1 ]; then
  exec sleep infinity  # a rollout node only hosts engine actors; the driver places them
fi

exec $PY -m torch.distributed.run --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC_PER_NODE" \
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" train.py "$@"
