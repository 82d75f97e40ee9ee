"""Typed reads of ds_config values and the running report of a translation.

Every failed read is a ConfigError (a UserError every rank finds alike) that names the DeepSpeed key, its value
and the fix.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from glm45v_fsdp.errors import ConfigError


class DeepSpeedAssertion(ConfigError, AssertionError):
    """A user error DeepSpeed reports with `assert` (the batch arithmetic, ...): `except AssertionError` catches
    it as it catches DeepSpeed's, and it is a ConfigError (a user error with a clear message) here."""


def key_error(path: str, value: Any, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"DeepSpeed config key '{path}' = {value!r} {problem}. {fix}")


def unknown_key_error(path: str, value: Any, valid: Iterable[str], why: str) -> ConfigError:
    prefix, _, leaf = path.rpartition(".")
    close = difflib.get_close_matches(leaf, sorted(valid), n=1, cutoff=0.6)
    hint = f"Did you mean '{prefix + '.' if prefix else ''}{close[0]}'? " if close else ""
    return key_error(path, value, f"is not accepted: {why}", f"{hint}Remove or rename the key.")


def check_keys(path: str, section: dict, valid: Iterable[str], why: str) -> None:
    """Reject keys outside `valid`, as DeepSpeed's pydantic models (extra="forbid") do."""
    valid = set(valid)
    for key, value in section.items():
        if key not in valid:
            raise unknown_key_error(f"{path}.{key}", value, valid, why)


def as_section(path: str, value: Any) -> dict:
    """A nested section; null reads as empty, as in DeepSpeed."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise key_error(path, value, "is not a section", 'Write it as a JSON object, e.g. {"enabled": true}.')
    return value


def as_bool(path: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise key_error(path, value, "is not a boolean", "Write true or false.")
    return value


def as_int(path: str, value: Any, minimum: int | None = None) -> int:
    """An integer; integral floats (1e9 in JSON) are accepted, as DeepSpeed's arithmetic does."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise key_error(path, value, "is not an integer", "Write a whole number.")
    if minimum is not None and value < minimum:
        raise key_error(path, value, f"is below {minimum}", f"Write an integer >= {minimum}.")
    return int(value)


def as_float(path: str, value: Any, minimum: float | None = None, positive: bool = False) -> float:
    if isinstance(value, (list, tuple)):
        raise key_error(
            path,
            value,
            "is a per-parameter-group list, which the translation does not support",
            "Give one number for all parameter groups.",
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise key_error(path, value, "is not a number", "Write a number.")
    if positive and value <= 0:
        raise key_error(path, value, "is not positive", "Write a number > 0.")
    if minimum is not None and value < minimum:
        raise key_error(path, value, f"is below {minimum}", f"Write a number >= {minimum}.")
    return float(value)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_value(value: Any) -> str:
    """A value as a person writes it on our command line (YAML scalars): for reports, never read back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def render_fields(fields: Mapping[str, Any]) -> list[str]:
    """Typed config fields as `key.path=value` lines for people (logs, explain); nothing parses them."""
    return [f"{key}={format_value(value)}" for key, value in fields.items()]


TAKEN, MAPPED, NO_EFFECT, UNKNOWN = "taken", "mapped", "no effect", "not a DeepSpeed key"


@dataclass
class Report:
    """What a translation found: our config fields (key path -> typed value), keys without effect (each once),
    differences from DeepSpeed, and what became of each ds_config key (`answers`: key path -> (taken | mapped |
    no effect, how)); a key the backend cannot honour is refused with a ConfigError instead."""

    fields: dict[str, Any] = field(default_factory=dict)
    no_effect: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    trainer_notes: set[str] = field(default_factory=set)  # notes about our trainer's door only (not the engine API)
    misspelled: list[str] = field(default_factory=list)  # top-level keys close to a DeepSpeed key: warnings
    answers: dict[str, tuple[str, str]] = field(default_factory=dict)

    def override(self, key: str, value: Any, source: str | None = None) -> None:
        """Set our config key `key` to `value`; a key set again moves to the end (the order the report shows).
        `source`: the ds_config key it comes from (or would, when given), which is then answered as mapped onto it;
        the key table walks the ds_config, so the answer of a key it does not hold is never shown."""
        self.fields.pop(key, None)
        self.fields[key] = value
        if source is not None:
            target = f"{key}={format_value(value)}"
            kind, how = self.answers.get(source, (MAPPED, ""))
            if kind != MAPPED or not how:
                self.answers[source] = (MAPPED, target)
            elif target not in how.split(", "):
                self.answers[source] = (MAPPED, f"{how}, {target}")

    def answered(self, path: str) -> bool:
        """Whether ds_config key `path`, or a section holding it, has its answer."""
        parts = path.split(".")
        return any(".".join(parts[:end]) in self.answers for end in range(1, len(parts) + 1))

    def take(self, path: str, how: str) -> None:
        """ds_config key `path` is taken with DeepSpeed's meaning; `how` says what does it here."""
        self.answers[path] = (TAKEN, how)

    def mapped(self, path: str, how: str) -> None:
        """ds_config key `path` is mapped onto our equivalent, `how`."""
        self.answers[path] = (MAPPED, how)

    def answer_params(self, section: str, params: Iterable[str], kind: str, callee: str) -> None:
        """Each `section.params.<key>` not answered yet: `kind` (taken or mapped), an argument of `callee`."""
        for key in params:
            self.answers.setdefault(f"{section}.params.{key}", (kind, f"{callee}({key}=...)"))

    def ignore(self, path: str, why: str = "") -> None:
        """ds_config key `path` (a whole section: every key in it) has no effect on the FSDP2 backend."""
        if path not in self.no_effect:
            self.no_effect.append(path)
        self.answers.setdefault(path, (NO_EFFECT, why))

    def unknown(self, path: str, note: str = "") -> None:
        """ds_config key `path` is not a DeepSpeed key: DeepSpeed ignores it, and so does the translation (noted)."""
        self.answers[path] = (UNKNOWN, "DeepSpeed ignores it too")
        self.note(note or f"'{path}' is not a DeepSpeed key: DeepSpeed ignores it, and so does the translation.")

    def note(self, text: str, door: Literal["both", "trainer"] = "both") -> None:
        """A difference from DeepSpeed or a warning; door="trainer": it concerns only our trainer's --deepspeed door
        (its own features and schedule), so the engine API does not repeat it."""
        if text not in self.notes:
            self.notes.append(text)
        if door == "trainer":
            self.trainer_notes.add(text)
