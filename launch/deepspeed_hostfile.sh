#!/usr/bin/env bash
# Multi-node training from a deepspeed hostfile, with our ds-fsdp launcher (default) or the real deepspeed launcher.
# Usage (any node that reaches the hosts by passwordless ssh; the repository at the same path on every node):
#   launch/deepspeed_hostfile.sh [key.path=value ...]                       # ds-fsdp: pdsh, one torchrun per node
#   LAUNCHER=deepspeed launch/deepspeed_hostfile.sh [key.path=value ...]    # DeepSpeed's runner (pip install deepspeed)
#   LAUNCHER_FLAGS="-i worker-0:0,1@worker-1" launch/deepspeed_hostfile.sh  # any launcher flag: filters, --launcher ...
#   LAUNCHER_FLAGS=--dry_run launch/deepspeed_hostfile.sh                   # ds-fsdp only: print the plan as JSON
#   DS_CONFIG=launch/ds_config_zero3_bf16.json launch/deepspeed_hostfile.sh # batch/optimizer/ZeRO from a ds_config
# Settings: HOSTFILE (default launch/hostfile), CONFIG (configs/glm45v_tiny.yaml), DS_CONFIG (none), MASTER_ADDR
# (default: the first host), MASTER_PORT (29500). Both launchers copy NCCL_*/HCCL_*/ASCEND_*/PYTHON* and .deepspeed_env to every node.
set -euo pipefail
cd "$(dirname "$0")/.."
LAUNCHER=${LAUNCHER:-ds-fsdp}
HOSTFILE=${HOSTFILE:-launch/hostfile}
CONFIG=${CONFIG:-configs/glm45v_tiny.yaml}
MASTER_PORT=${MASTER_PORT:-29500}
# LAUNCHER and LAUNCHER_FLAGS are word lists on purpose (e.g. LAUNCHER="python -m ds_compat.launcher").
# shellcheck disable=SC2086
exec $LAUNCHER --hostfile "$HOSTFILE" --master_port "$MASTER_PORT" ${MASTER_ADDR:+--master_addr "$MASTER_ADDR"} \
    ${LAUNCHER_FLAGS:-} --module glm45v_fsdp.train --config "$CONFIG" ${DS_CONFIG:+--deepspeed "$DS_CONFIG"} "$@"
