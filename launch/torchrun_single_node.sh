#!/usr/bin/env bash
# One node, NPROC processes (one per device; on CPU any number works over gloo).
# Usage: launch/torchrun_single_node.sh [NPROC] [--config C] [key.path=value ...]   (NPROC defaults to 2)
# --standalone picks a free rendezvous port on this host. The exit code is torchrun's: 0, or 1 when any rank fails.
set -euo pipefail
NPROC=2
if [[ ${1:-} =~ ^[0-9]+$ ]]; then
    NPROC=$1
    shift
fi
exec torchrun --standalone --nproc_per_node "$NPROC" -m glm45v_fsdp.train "$@"
