#!/usr/bin/env bash
# One node, NPROC processes (one per device; on CPU any number works over gloo).
# Usage: launch/torchrun_single_node.sh [NPROC] [--config C] [key.path=value ...]
set -euo pipefail
NPROC=${1:-2}
shift || true
exec torchrun --standalone --nproc_per_node "$NPROC" -m glm45v_fsdp.train "$@"
