"""The deepspeed launcher's hostfile (`worker-0 slots=4`) and resource filters (`-i worker-0:0,1@worker-1`, `-e`).

Resolution follows `deepspeed.launcher.runner` (`fetch_hostfile`, `parse_inclusion_exclusion`,
`apply_num_nodes_and_gpus`) result for result; its deliberate error messages are kept word for word and followed by
the fix, and input it would crash on (a bad slot number, two colons) is a `UserError` as well.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from glm45v_fsdp.errors import UserError

Resources = dict[str, list[int]]
"""host -> slot (device) ids, in hostfile order: deepspeed's "world info"."""

_HOST_LINE = re.compile(r"(\S+)\s+slots=(\d+)")
_FILTER_SYNTAX = "NODE_SPEC[@NODE_SPEC ...] with NODE_SPEC = NAME[:SLOT[,SLOT ...]], e.g. 'worker-0:0,1@worker-1'"


def parse_hostfile(lines: Iterable[str], source: str = "the hostfile") -> dict[str, int]:
    """`HOST slots=N` lines -> {host: N}; `#` comments and blank lines are skipped, text after `slots=N` ignored."""
    pool: dict[str, int] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        found = _HOST_LINE.match(line)
        if found is None:
            raise UserError(
                f"Hostfile contains a bad entry: {line}, unable to proceed with launching ({source}, line {number}). "
                f"Each line must be 'HOSTNAME slots=N' (e.g. 'worker-0 slots=8'), a '#' comment or blank."
            )
        host = found.group(1)
        if host in pool:
            raise UserError(
                f"Hostfile contains multiple entries for {host}, unable to proceed with launching ({source}, line "
                f"{number}). List each host once, with all its slots."
            )
        pool[host] = int(found.group(2))
    if not pool:
        raise UserError(
            f"Hostfile is empty or not formatted correctly, unable to proceed with launching ({source}). Add lines "
            f"like 'worker-0 slots=8', or pass a hostfile path that does not exist to run on this machine only."
        )
    return pool


def read_hostfile(path: str) -> dict[str, int] | None:
    """The hostfile at `path`, or None when there is no such file (deepspeed then runs on local devices only)."""
    file = Path(path)
    if not file.is_file():
        return None
    return parse_hostfile(file.read_text().splitlines(), str(file))


def parse_filter(spec: str, flag: str) -> Resources:
    """`NAME[:SLOT,...]@...` -> {host: sorted unique slots}; [] means the whole host. Slots of one host accumulate."""
    wanted: dict[str, set[int]] = {}
    for entry in spec.split("@"):
        host, colon, slot_text = entry.partition(":")
        slots = wanted.setdefault(host, set())
        if not colon:
            continue
        try:
            if ":" in slot_text:
                raise ValueError(slot_text)
            slots.update(int(slot) for slot in slot_text.split(","))
        except ValueError:
            raise UserError(f"{flag} {spec!r}: bad entry {entry!r}. Expected {_FILTER_SYNTAX}.") from None
    return {host: sorted(slots) for host, slots in wanted.items()}


def filter_resources(available: Resources, include: str = "", exclude: str = "") -> Resources:
    """Keep only the `include`d slots, or drop the `exclude`d ones; hosts left without slots are dropped."""
    if include and exclude:
        raise UserError(
            "include_str and exclude_str are mutually exclusive. Pass either --include or --exclude, not both."
        )
    if not include and not exclude:
        return {host: list(slots) for host, slots in available.items()}
    flag, spec = ("--include", include) if include else ("--exclude", exclude)
    chosen = {} if include else {host: list(slots) for host, slots in available.items()}
    for host, slots in parse_filter(spec, flag).items():
        if host not in available:
            raise UserError(
                f"Hostname '{host}' not found in hostfile ({flag} {spec!r}). Known hosts: {', '.join(available)}."
            )
        for slot in slots:
            if slot not in available[host]:
                raise UserError(
                    f"No slot '{slot}' specified on host '{host}' ({flag} {spec!r}). Its slots are {available[host]}."
                )
        if include:
            chosen[host] = slots or list(available[host])
        else:
            chosen[host] = [slot for slot in chosen[host] if slot not in slots] if slots else []
    return {host: chosen[host] for host in available if chosen.get(host)}


def limit_resources(active: Resources, num_nodes: int, num_gpus: int) -> Resources:
    """The first `num_nodes` hosts; `num_gpus` > 0 sets every host's slots to 0..num_gpus-1 (even beyond its slots)."""
    if num_nodes > 0:
        active = dict(list(active.items())[:num_nodes])
    if num_gpus > 0:
        active = {host: list(range(num_gpus)) for host in active}
    return active


def check_filter_flags(include: str, exclude: str, num_nodes: int, num_gpus: int) -> None:
    """--num_nodes/--num_gpus (any value >= 0) and --include/--exclude do not combine."""
    if (num_nodes >= 0 or num_gpus >= 0) and (include or exclude):
        raise UserError(
            "Cannot specify num_nodes/gpus with include/exclude. Drop --num_nodes/--num_gpus, or drop "
            "--include/--exclude."
        )


def resolve_world(pool: dict[str, int], include: str, exclude: str, num_nodes: int, num_gpus: int) -> Resources:
    """Slot counts + the launcher's filter flags -> the world info (deepspeed's `active_resources`)."""
    check_filter_flags(include, exclude, num_nodes, num_gpus)
    active = filter_resources({host: list(range(slots)) for host, slots in pool.items()}, include, exclude)
    return limit_resources(active, num_nodes, num_gpus)
