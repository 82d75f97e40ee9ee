"""Every process group of several layouts as this rank's meshes hold them, and where the ranks run.

python tests/multinode_groups.py OUT_DIR LAYOUT_JSON   (under a launcher, one process per rank)

LAYOUT_JSON: {"name": {"parallel.key": value, ...}, ...}. Writes OUT_DIR/rank{R}.json: this rank's host name and,
per layout, its group of each family (runtime/topology.py's FAMILIES) read off the meshes runtime/mesh.py builds,
and the topology line the trainer would log.
"""

import json
import socket
import sys
from pathlib import Path

from glm45v_fsdp.config import load_config
from glm45v_fsdp.runtime import ParallelMeshes, build_parallel_dims, detect_dist_env, init_distributed, select_device
from glm45v_fsdp.runtime.topology import FAMILIES, describe_placement, detect_layout

out, layouts = Path(sys.argv[1]), json.loads(sys.argv[2])
env = detect_dist_env()
init_distributed(env, select_device("cpu"), peer_timeout_s=0)
nodes = detect_layout()
result = {"rank": env.rank, "host": socket.gethostname(), "layouts": {}}
for name, overrides in layouts.items():
    config = load_config(None, [f"{key}={value}" for key, value in overrides.items()])
    dims = build_parallel_dims(config.parallel, env.world_size)
    meshes = ParallelMeshes(dims, "cpu")
    groups = {family: sorted(getattr(meshes, family).mesh.flatten().tolist()) for family in FAMILIES}
    result["layouts"][name] = {"groups": groups, "topology": describe_placement(dims, nodes)}
(out / f"rank{env.rank}.json").write_text(json.dumps(result))
