#!/usr/bin/env bash
# Launch training on one node or many. Every node runs this script; node 0 also starts the Ray head and drives.
#
#   ./torchrun.sh --max_steps=5                                    # one node, the tiny default (CPU or GPU)
#   NPROC_PER_NODE=6 ./torchrun.sh --config configs/qwen3_4b.py    # one 8-GPU node: 6 train, 2 engines roll out
#   ROLLOUT_NODES=1 ./torchrun.sh --config configs/qwen3_30b_a3b.py                # node 0: 8 GPUs train, and on
#   ROLLOUT_NODE=1 MASTER_ADDR=node0 ./torchrun.sh                                 # a 2nd node the 8 engines run
#   NNODES=64 NODE_RANK=$i ROLLOUT_NODES=16 MASTER_ADDR=node0 ./torchrun.sh --config configs/moe_700b.py  # node i
#
# Plan first, on any machine (no GPU, seconds): python train.py --config configs/moe_700b.py --dry_run=True
# train_world_size in the config must equal NNODES x NPROC_PER_NODE (the run stops at once otherwise).
#
# Environment (all optional on one node):
#   NNODES         number of trainer nodes (default 1)
#   NODE_RANK      this node's rank among them (default 0)
#   MASTER_ADDR    address of node 0 (default 127.0.0.1); MASTER_PORT (default 29500)
#   NPROC_PER_NODE trainer ranks per node (default: all visible GPUs, or 1 on a CPU machine)
#   RAY_PORT       Ray head port on node 0 (default 6379)
#   ROLLOUT_NODE=1 this node only joins Ray as a rollout (vLLM engine) node and runs no trainer rank
#   ROLLOUT_NODES  how many rollout nodes will join (default 0); node 0 starts a Ray head when NNODES > 1 or
#                  ROLLOUT_NODES > 0, and otherwise lets the driver start a local Ray
#
# Slurm example (sbatch file): 64 trainer nodes + 16 rollout nodes in one allocation, node 0 is the head.
#   #!/bin/bash
#   #SBATCH --nodes=80 --gpus-per-node=8 --ntasks-per-node=1 --exclusive
#   head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
#   srun bash -c 'if [ "$SLURM_NODEID" -lt 64 ]; then
#                   NNODES=64 ROLLOUT_NODES=16 NODE_RANK=$SLURM_NODEID MASTER_ADDR='"$head"' \
#                     ./torchrun.sh --config configs/moe_700b.py
#                 else ROLLOUT_NODE=1 MASTER_ADDR='"$head"' ./torchrun.sh; fi'
# Trainer nodes finish with torchrun; node 0 then stops the Ray head, and the rollout nodes see it go and exit.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
RAY_PORT=${RAY_PORT:-6379}
ROLLOUT_NODE=${ROLLOUT_NODE:-0}
ROLLOUT_NODES=${ROLLOUT_NODES:-0}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$($PY -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
ray_cli() { $PY -m ray.scripts.scripts "$@"; }

# Ray: the head on node 0, every other node joins it; the driver (trainer rank 0) connects with address="auto".
# One node alone needs none of this: the driver's ray.init() starts a local cluster and stops it at the end.
join_ray() {  # retry while the head is still starting
  for _ in $(seq 60); do
    ray_cli start --address="$MASTER_ADDR:$RAY_PORT" --disable-usage-stats && return 0
    sleep 5
  done
  echo "torchrun.sh: no Ray head at $MASTER_ADDR:$RAY_PORT after 5 minutes" >&2
  exit 1
}
if [ "$ROLLOUT_NODE" = 1 ]; then
  # a rollout node only hosts engine actors (the driver places them); it serves until the head goes away
  join_ray
  while ray_cli status --address="$MASTER_ADDR:$RAY_PORT" >/dev/null 2>&1; do sleep 30; done
  ray_cli stop >/dev/null 2>&1 || true
  exit 0
fi
if [ "$NNODES" -gt 1 ] || [ "$ROLLOUT_NODES" -gt 0 ]; then
  if [ "$NODE_RANK" = 0 ]; then
    ray_cli start --head --port="$RAY_PORT" --disable-usage-stats
  else
    join_ray
  fi
  trap 'ray_cli stop >/dev/null 2>&1 || true' EXIT  # this node's Ray processes end with the training
  export RAY_ADDRESS=auto
fi

$PY -m torch.distributed.run --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC_PER_NODE" \
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" train.py "$@"
