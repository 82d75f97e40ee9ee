# Ascend NPU environment for glm45v-fsdp (CANN, HCCL, torch_npu). Source it on every node before training:
#   . launch/ascend_env.sh
# ds-fsdp and deepspeed copy HCCL_* and ASCEND_* from the launching shell to every node, but not the other variables
# below: pass --venv_script launch/ascend_env.sh so each node sources this file itself.
# Every setting is a default: a value already in the environment wins. Meanings follow the CANN 8 / torch_npu 2.x
# documentation; check them against your versions (no NPU runs in this project's CI).

# CANN toolkit: PATH, LD_LIBRARY_PATH, PYTHONPATH and ASCEND_* for the runtime and operator libraries.
ASCEND_SET_ENV=${ASCEND_SET_ENV:-/usr/local/Ascend/ascend-toolkit/set_env.sh}
if [ -f "$ASCEND_SET_ENV" ]; then
    # shellcheck disable=SC1090
    . "$ASCEND_SET_ENV"
fi

# --- HCCL (collective communication) ---
# Seconds a rank waits for its peers when a communicator is built (HCCL default 120). 128 ranks that load weights
# before their first collective need more.
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1200}
# Seconds a collective waits for its peers before HCCL reports a timeout (HCCL default 1836). Keep it above the
# longest gap between two collectives (a checkpoint save, a slow data-loading step).
export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-1800}
# Which host network interface HCCL uses for its TCP rendezvous, on hosts with several NICs. Set one of the two:
#   HCCL_SOCKET_IFNAME: interface name(s), e.g. eth0 or enp189s0f0 (the same on every node: easiest);
#   HCCL_IF_IP: this host's IP address (differs per node: set it in a per-node script, not in .deepspeed_env).
# export HCCL_SOCKET_IFNAME=eth0
# export HCCL_IF_IP=192.168.1.10
# Size in MB of the buffer HCCL uses per communicator (default 200); larger can speed up big all-gathers and
# reduce-scatters at the cost of device memory.
export HCCL_BUFFSIZE=${HCCL_BUFFSIZE:-200}
# HCCL_DETERMINISTIC is set by glm45v-fsdp itself when training.deterministic is true (docs/runtime.md).

# --- Devices ---
# The NPUs this node's processes may use, like CUDA_VISIBLE_DEVICES. Leave it unset under ds-fsdp / deepspeed: they
# set it per node from the hostfile slots. Set it for plain torchrun on a shared node.
# export ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7

# --- Runtime ---
# 1 makes every operator launch synchronous, so an error names the failing operator; much slower: debugging only.
export ASCEND_LAUNCH_BLOCKING=${ASCEND_LAUNCH_BLOCKING:-0}
# Operator dispatch queue: 0 off, 1 dispatch on a second thread, 2 also moves more of the launch work off the main
# thread (recommended for training).
export TASK_QUEUE_ENABLE=${TASK_QUEUE_ENABLE:-2}
# CPU core binding: 0 off, 1 bind each process to the cores of its NPU's NUMA node, 2 finer (per-thread) binding.
export CPU_AFFINITY_CONF=${CPU_AFFINITY_CONF:-1}
# Caching allocator: expandable segments cut fragmentation from varying sizes (FSDP all-gathers, packed sequences).
export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}
# Fuse the copies that make non-contiguous tensors contiguous into fewer operators (torch_npu).
export COMBINED_ENABLE=${COMBINED_ENABLE:-1}

# --- Logging ---
# CANN log level: 0 debug, 1 info, 2 warning, 3 error. Debug and info logging slow training down.
export ASCEND_GLOBAL_LOG_LEVEL=${ASCEND_GLOBAL_LOG_LEVEL:-3}
# 1 also prints the CANN logs on stdout; 0 keeps them in ~/ascend/log only.
export ASCEND_SLOG_PRINT_TO_STDOUT=${ASCEND_SLOG_PRINT_TO_STDOUT:-0}
