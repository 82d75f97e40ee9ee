"""`deepspeed.runtime.config_utils`: the base of DeepSpeed's pydantic config sections, so the sections ds_compat
provides (`zero.config`, `zero.offload_config`, `runtime.precision_config`) read and reject keys as DeepSpeed's do.

A section rejects keys it does not define, accepts a field's name or its alias, validates assignments, drops "auto"
values (their defaults apply: the HF Trainer fills the ones that matter before DeepSpeed sees them) and moves a
deprecated key's value onto the key that replaced it (`DEPRECATED`, or a field marked deprecated as DeepSpeed marks
them), warning once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from ds_compat._common import DeepSpeedAssertion
from glm45v_fsdp.log import get_logger

logger = get_logger()


class DeepSpeedConfigModel(BaseModel):
    model_config = ConfigDict(
        validate_default=True,
        validate_assignment=True,
        use_enum_values=True,
        populate_by_name=True,
        extra="forbid",
        arbitrary_types_allowed=True,
        protected_namespaces=(),
    )
    # deprecated field -> (the field that replaced it or None, how its value converts)
    DEPRECATED: ClassVar[dict[str, tuple[str | None, Callable[[Any], Any]]]] = {}

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:
            data = {key: value for key, value in data.items() if not (isinstance(value, str) and value == "auto")}
        super().__init__(**data)
        for old, (new, convert) in self.deprecations().items():
            if old not in self.model_fields_set:
                continue
            logger.warning(f"DeepSpeed config key {old} is deprecated" + (f": its value now sets {new}" if new else ""))
            if new is None:
                continue
            if new in self.model_fields_set:
                raise DeepSpeedAssertion(
                    f"Cannot provide deprecated parameter '{old}' and replacing parameter '{new}' together. Keep "
                    f"'{new}' only."
                )
            value = convert(getattr(self, old))
            delattr(self, old)  # the value lives on under its new name only, as in DeepSpeed
            setattr(self, new, value)

    @classmethod
    def deprecations(cls) -> dict[str, tuple[str | None, Callable[[Any], Any]]]:
        """DEPRECATED, and the fields marked as DeepSpeed marks them: `Field(json_schema_extra={"deprecated": True,
        "new_param": ..., "new_param_fn": ..., "set_new_param": ...})` (a section written against DeepSpeed's base)."""
        table = dict(cls.DEPRECATED)
        for name, field in cls.model_fields.items():
            extra = field.json_schema_extra
            if name in table or not isinstance(extra, dict) or not extra.get("deprecated"):
                continue
            new = (extra.get("new_param") or None) if extra.get("set_new_param", True) else None
            table[name] = (new, extra.get("new_param_fn", _unchanged))
        return table


def _unchanged(value: Any) -> Any:
    return value


def get_scalar_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    return param_dict.get(param_name, param_default_value)
