"""Run a script on the real deepspeed without its CPU shared-memory all-reduce op.

DeepSpeed's CPU accelerator JIT-compiles that op (`deepspeed_shm_comm`) the first time a process group starts:
about 3 minutes on the 2-core CI machine and a C++ compiler required. The reference runs then all-reduce over plain
gloo, as ds_compat does; the script itself runs unchanged.

python tests/ds_reference_runner.py SCRIPT [ARGS ...]   (under torchrun, or as the deepspeed launcher's script)
"""

import importlib
import runpy
import sys

# `deepspeed.comm.torch` as an attribute is the torch package (deepspeed.comm star-imports it): go by module name.
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
# DeepSpeed's per-node launcher puts `--local_rank=N` before the script's arguments, which start with the script.
local_rank = [arg for arg in sys.argv[1:] if arg.startswith("--local_rank=")]
script, *arguments = [arg for arg in sys.argv[1:] if arg not in local_rank]
sys.argv = [script, *local_rank, *arguments]
runpy.run_path(script, run_name="__main__")
