#!/usr/bin/env bash
#SBATCH --job-name=glm45v-fsdp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
# Multi-node training under Slurm: srun starts one torchrun per node, each torchrun starts NPROC_PER_NODE ranks.
# Usage, from the repository root (a shared filesystem):
#   sbatch [--nodes N] launch/slurm_sbatch.sh [--config C] [key.path=value ...]
# Settings: NPROC_PER_NODE (accelerators per node, default 8), MASTER_PORT (29500), ENV_SCRIPT (a script sourced
# first, e.g. ENV_SCRIPT=launch/ascend_env.sh on Ascend; srun passes the environment on to every node).
# The request for accelerators is site-specific: add e.g. --gpus-per-node=8 or --gres=npu:8 to the sbatch line.
set -eo pipefail
if [ -n "${ENV_SCRIPT:-}" ]; then
    # shellcheck disable=SC1090
    . "$ENV_SCRIPT"
fi
set -u
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)}  # rank 0's node
MASTER_PORT=${MASTER_PORT:-29500}
export NPROC_PER_NODE MASTER_ADDR MASTER_PORT
# --kill-on-bad-exit=1: a node whose torchrun fails (it exits 1 when a rank fails) ends the whole step at once;
# the step's exit code is the job's. The single quotes keep $SLURM_NODEID for each task to expand.
exec srun --kill-on-bad-exit=1 --ntasks-per-node=1 bash -c '
    exec python -m torch.distributed.run --nnodes "$SLURM_NNODES" --node_rank "$SLURM_NODEID" \
        --nproc_per_node "$NPROC_PER_NODE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
        -m glm45v_fsdp.train "$@"' glm45v-node "$@"
