"""Every key of a ds_config and what became of it: the translation's table, one row a key path.

A key is taken (DeepSpeed's meaning, done here), mapped (onto our equivalent, named), of no effect on the FSDP2
backend (listed, with the reason where one is given), or not a DeepSpeed key (DeepSpeed ignores it too). A key the
backend cannot honour never reaches the table: the translation refuses it with a ConfigError naming the key. A
section takes the answer given for it as a whole, else each of its keys is answered on its own row (an empty section
means DeepSpeed's defaults, which the translation applies as if the section were absent).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ds_compat._common import TAKEN

SECTION = "section"  # a section whose keys are answered one by one, on their own rows
UNANSWERED = "unanswered"  # a translation bug: tests/test_ds_schema.py fails on it


@dataclass(frozen=True)
class KeyAnswer:
    path: str
    value: Any
    kind: str  # taken | mapped | no effect | not a DeepSpeed key | section | unanswered
    how: str

    def line(self) -> str:
        value = repr(self.value) if not isinstance(self.value, dict) else "{...}" if self.value else "{}"
        value = value if len(value) <= 40 else value[:37] + "..."
        return f"{self.path} = {value}: {self.kind}{f' ({self.how})' if self.how else ''}"


def key_paths(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every key path of a nested config, each section before its keys."""
    for key, value in tree.items():
        path = f"{prefix}{key}"
        yield path, value
        if isinstance(value, dict):
            yield from key_paths(value, path + ".")


def answer_keys(ds: Mapping[str, Any], answers: Mapping[str, tuple[str, str]]) -> list[KeyAnswer]:
    """The table for `ds` from a translation's answers (key path -> (kind, how))."""
    rows = []
    for path, value in key_paths(ds):
        whole = next((a for a in _ancestors(path) if a in answers), None)
        if path in answers:
            kind, how = answers[path]
        elif whole is not None:
            kind, how = answers[whole][0], f"with {whole}"
        elif isinstance(value, dict):
            kind, how = (SECTION, "its keys below") if value else (TAKEN, "empty: DeepSpeed's defaults")
        else:
            kind, how = UNANSWERED, "the translation did not say what became of it"
        rows.append(KeyAnswer(path, value, kind, how))
    return rows


def _ancestors(path: str) -> list[str]:
    """a.b.c -> [a.b, a]: the nearest first."""
    parts = path.split(".")
    return [".".join(parts[:end]) for end in range(len(parts) - 1, 0, -1)]
