"""`deepspeed.launcher.runner`: the deepspeed launcher's module. Its command line and `main` are ds-fsdp's
(ds_compat/launcher.py; `main(args)` raises a bad launch's ValueError, as DeepSpeed's does); the hostfile and filter
functions that cluster tools call are here, on ds_compat.hostfile (OrderedDicts in hostfile order as DeepSpeed
returns; ValueErrors with DeepSpeed's messages followed by the fix).
"""

from __future__ import annotations

import base64
import collections
import json
import sys

from ds_compat.hostfile import Resources, filter_resources, limit_resources, parse_hostfile, read_hostfile
from ds_compat.launcher import DEEPSPEED_ENVIRONMENT_NAME, DLTS_HOSTFILE, PDSH_MAX_FAN_OUT, launch, log, parse_args

__all__ = [
    "DEEPSPEED_ENVIRONMENT_NAME",
    "DLTS_HOSTFILE",
    "PDSH_MAX_FAN_OUT",
    "apply_num_nodes_and_gpus",
    "encode_world_info",
    "fetch_hostfile",
    "main",
    "parse_args",
    "parse_inclusion_exclusion",
    "parse_resource_filter",
]


def main(args: list[str] | None = None) -> int:
    """deepspeed.launcher.runner.main: ds-fsdp on `args` (sys.argv's when None); a bad launch raises its ValueError
    (UserError) to the caller, as DeepSpeed's main does, instead of printing it as the `ds-fsdp` command does."""
    return launch(sys.argv[1:] if args is None else args)


def fetch_hostfile(hostfile_path: str) -> collections.OrderedDict | None:
    """The hostfile's {host: slot count} in file order; None (with deepspeed's warning) when there is no such file."""
    pool = read_hostfile(hostfile_path)
    if pool is None:
        log.warning("Unable to find hostfile, will proceed with training with local resources only.")
        return None
    return collections.OrderedDict(pool)


def _parse_hostfile(hostfile_lines: list[str]) -> collections.OrderedDict:
    return collections.OrderedDict(parse_hostfile(hostfile_lines))


def parse_resource_filter(host_info: Resources, include_str: str = "", exclude_str: str = "") -> Resources:
    """{host: slot ids} filtered by an --include or --exclude string (NAME[:SLOT[,SLOT ...]][@...]), host order kept."""
    return collections.OrderedDict(filter_resources(host_info, include_str, exclude_str))


def parse_inclusion_exclusion(resource_pool: dict[str, int], inclusion: str, exclusion: str) -> Resources:
    """{host: slot count} -> {host: slot ids} left by the --include / --exclude strings."""
    return parse_resource_filter({host: list(range(n)) for host, n in resource_pool.items()}, inclusion, exclusion)


def apply_num_nodes_and_gpus(active_resources: Resources, num_nodes: int, num_gpus: int) -> Resources:
    return collections.OrderedDict(limit_resources(active_resources, num_nodes, num_gpus))


def encode_world_info(world_info: Resources) -> str:
    """The world info as deepspeed hands it to its per-node launcher: URL-safe base64 of its JSON."""
    return base64.urlsafe_b64encode(json.dumps(world_info).encode("utf-8")).decode("utf-8")
