"""Our trainer behind DeepSpeed's door: `python -m glm45v_fsdp.train --deepspeed ds_config.json [key=value ...]`.

The ds_config supplies what a DeepSpeed job sets there — batch sizes, optimizer, scheduler, precision, ZeRO stage
(sharding), offload, clipping, activation checkpointing, logging — and our YAML config the model and the data.
`configure` translates (ds_compat.config.translate, "auto" values filled from the YAML), refuses a command-line
override that contradicts the ds_config, and returns the config and the optimizer recipe the Trainer runs with.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ds_compat.config import Translation, explain_text, translate
from glm45v_fsdp.config import Config
from glm45v_fsdp.errors import UserError
from glm45v_fsdp.optim import OptimizerRecipe, recipe_from_training


@dataclass
class DeepSpeedRun:
    config: Config
    recipe: OptimizerRecipe
    translation: Translation
    source: str

    def explain(self) -> str:
        return explain_text(self.translation, self.source)


def recipe_from_translation(translation: Translation, config: Config) -> OptimizerRecipe:
    """The ds_config's optimizer; its scheduler when it has one, else our training.* schedule at its lr (as the HF
    Trainer integration keeps its own scheduler when the ds_config names none)."""
    spec = translation.optimizer
    schedule = translation.scheduler
    if schedule is None:
        ours = recipe_from_training(dataclasses.replace(config.training, lr=spec.lr))
        return OptimizerRecipe(spec.type, dict(spec.kwargs), ours.lr_after, f"{ours.schedule} (training.*)")
    return schedule.recipe(spec)


def _value(config: Config, key: str) -> object:
    node: object = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _conflicts(cli_overrides: list[str], base: Config, translated: Config, mapped_keys: set[str]) -> list[str]:
    """Command-line keys (the user's `key=value` words) the ds_config also sets, to another (typed) value."""
    keys = dict.fromkeys(item.partition("=")[0] for item in cli_overrides)
    return [
        f"{key}={_value(base, key)!r} on the command line, {key}={_value(translated, key)!r} from the ds_config"
        for key in keys
        if key in mapped_keys and _value(base, key) != _value(translated, key)
    ]


def configure(ds_source: str | os.PathLike, base: Config, cli_overrides: list[str], world_size: int) -> DeepSpeedRun:
    """Translate the ds_config for `world_size` ranks onto `base` (our YAML with the command-line overrides)."""
    translation = translate(ds_source, world_size, base)
    config = translation.apply(base)
    conflicts = _conflicts(cli_overrides, base, config, set(translation.fields))
    if conflicts:
        raise UserError(
            f"The command line and the DeepSpeed config '{ds_source}' set the same keys differently: "
            f"{'; '.join(conflicts)}. Under --deepspeed the ds_config decides these keys: change them there, or drop "
            "the key=value from the command line."
        )
    return DeepSpeedRun(config, recipe_from_translation(translation, config), translation, str(ds_source))
