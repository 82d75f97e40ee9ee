"""Module patterns shared by every plan (fsdp, freeze, recompute, offload, ep): the ground floor that `model/`,
`parallel/`, `memory/` and `ops/` all match modules with, so none of them reaches up into another to do it.

A pattern is a dotted module path whose segments may be
  - a literal name (`model.visual`),
  - `{*}` or `*`: any one segment (`model.language_model.layers.{*}`),
  - `{a-b,c,...}`: integer indices and inclusive ranges (`layers.{0-20,22-40}`).
Patterns match whole module names, never prefixes. A pattern that matches nothing is a user error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from glm45v_fsdp.errors import ConfigError

_BRACE = re.compile(r"^\{(.*)\}$")
_RANGE_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def _segment_regex(segment: str, pattern: str, key: str) -> str:
    if segment in ("*", "{*}"):
        return r"[^.]+"
    brace = _BRACE.match(segment)
    if brace is None:
        if not segment or any(ch in segment for ch in "{}*"):
            raise ConfigError(
                f"{key}: pattern {pattern!r} has a malformed segment {segment!r}; use a module name, '{{*}}' or "
                f"integer ranges such as '{{0-3,5}}'."
            )
        return re.escape(segment)
    indices: list[str] = []
    for item in brace.group(1).split(","):
        found = _RANGE_ITEM.match(item)
        if found is None:
            raise ConfigError(
                f"{key}: pattern {pattern!r} has a malformed range {segment!r}; write integers and inclusive ranges "
                f"such as '{{0-20,22-40}}'."
            )
        low = int(found.group(1))
        high = int(found.group(2)) if found.group(2) is not None else low
        if high < low:
            raise ConfigError(f"{key}: pattern {pattern!r} has the empty range {item.strip()!r} (end before start).")
        indices.extend(str(index) for index in range(low, high + 1))
    return "(?:" + "|".join(indices) + ")"


def compile_pattern(pattern: str, key: str = "pattern") -> re.Pattern[str]:
    """Turn one module pattern into a regular expression over full module names."""
    segments = pattern.strip().split(".")
    return re.compile("^" + r"\.".join(_segment_regex(s, pattern, key) for s in segments) + "$")


@dataclass(frozen=True)
class PlanMatch:
    """The modules one pattern selected, in model order."""

    pattern: str
    names: tuple[str, ...]


def match_modules(model: nn.Module, patterns: list[str], key: str) -> list[PlanMatch]:
    """Match each pattern against the model's module names; every pattern must match at least one module.

    `key` is the config key the patterns came from; it is named in the error.
    """
    names = [name for name, _ in model.named_modules() if name]
    matches: list[PlanMatch] = []
    unmatched: list[str] = []
    for pattern in patterns:
        regex = compile_pattern(pattern, key)
        selected = tuple(name for name in names if regex.match(name))
        if not selected:
            unmatched.append(pattern)
        matches.append(PlanMatch(pattern, selected))
    if unmatched:
        roots = sorted({name.split(".")[0] for name in names})
        raise ConfigError(
            f"{key}: pattern(s) {unmatched} match no module of {type(model).__name__}. Module names start with "
            f"{roots}; check the spelling against `python -m glm45v_fsdp.tools.preflight` or the model's "
            f"named_modules(), and remove patterns for modules this model does not have."
        )
    return matches


def format_matches(plan_name: str, matches: list[PlanMatch], outcome: str | None = None) -> str:
    """One log line per pattern: how many modules it matched, under a headline with what the plan did."""
    lines = [f"[plan {plan_name}] {len(matches)} pattern(s)" + (f"; {outcome}" if outcome else "")]
    lines += [f"  {m.pattern}: {len(m.names)} module(s)" for m in matches]
    return "\n".join(lines)
