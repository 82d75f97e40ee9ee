#!/usr/bin/env bash
# Full-parameter SFT of GLM-4.5V 106B on 16 nodes x 8 Ascend NPUs = 128 ranks (configs/glm45v_106b_sft.yaml).
# One torchrun per node, started in either of two ways:
#   on each node (by hand, pdsh, or a scheduler):  NODE_RANK=<0..15> MASTER_ADDR=<node 0> launch/glm45v_106b_sft.sh
#   by Slurm, one task per node:   sbatch --nodes=16 --ntasks-per-node=1 --exclusive \
#                                      --wrap "srun --kill-on-bad-exit=1 launch/glm45v_106b_sft.sh"
# Arguments are config overrides, e.g. model.name_or_path=/models/GLM-4.5V (its weights are the start)
# data.data_path=/data/sft.jsonl data.image_root=/data/images training.output_dir=/ckpt/sft. Settings: NNODES (16, or Slurm's node count),
# NPROC_PER_NODE (8), NODE_RANK (or SLURM_NODEID), MASTER_ADDR (or Slurm's first node), MASTER_PORT (29500),
# CONFIG, ENV_SCRIPT (launch/ascend_env.sh: CANN, HCCL and torch_npu settings; empty to skip).
# The exit code is torchrun's: 0, or 1 when any rank of this node failed (with srun --kill-on-bad-exit=1, one failed
# node stops the others).
set -eo pipefail
cd "$(dirname "$0")/.."
ENV_SCRIPT=${ENV_SCRIPT-launch/ascend_env.sh}
if [ -n "$ENV_SCRIPT" ]; then
    # shellcheck disable=SC1090
    . "$ENV_SCRIPT"
fi
set -u
NNODES=${NNODES:-${SLURM_NNODES:-16}}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-}}
if [ -z "${MASTER_ADDR:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
fi
: "${NODE_RANK:?set NODE_RANK to the rank of this node (0..NNODES-1), or run the script under srun}"
: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0, or run the script under srun}"
MASTER_PORT=${MASTER_PORT:-29500}
CONFIG=${CONFIG:-configs/glm45v_106b_sft.yaml}
exec python -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$NPROC_PER_NODE" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" -m glm45v_fsdp.train --config "$CONFIG" "$@"
