"""DeepSpeed compatibility layer for the glm45v-fsdp engine.

The package mirrors DeepSpeed's module tree, so that the paths scripts use resolve with `import ds_compat as deepspeed`
and, under ds-fsdp, with `import deepspeed` (ds_compat/alias.py maps the few whose place differs): a module standing for
a DeepSpeed module keeps its name (`runtime/config.py`, `zero/config.py`, `launchers/runner.py`, ...).

- `ds_compat.config`: ds_config.json translation (`python -m ds_compat.config explain`).
- `ds_compat.launcher`: the `ds-fsdp` launcher with the deepspeed launcher's flags.
- `ds_compat.trainer_door`: our trainer behind `--deepspeed ds_config.json` (the trainer door; the engine API below is
  the engine door: docs/architecture.md, "Doors").
- The engine API, so scripts written against DeepSpeed run on the FSDP2 core with `import ds_compat as deepspeed`:
  `initialize`, `add_config_arguments`, `init_distributed`, `comm` (deepspeed.comm), `DeepSpeedEngine`
  (forward / backward / step / save_checkpoint / load_checkpoint / save_16bit_model), `zero_to_fp32` and
  `checkpointing` (activation checkpointing for models that call deepspeed.checkpointing.checkpoint),
  `utils` (RepeatingLoader, log_dist).
  See docs/ds_compat.md, "Engine API".

The engine modules load on first use, so the config tools and the launcher stay light.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

__version__ = "0.19.8+fsdp2"  # the DeepSpeed API version the engine follows
__version_major__, __version_minor__, __version_patch__ = 0, 19, 8
__git_hash__ = __git_branch__ = "[fsdp2]"  # no DeepSpeed build: ds_compat/git_version_info.py

_LAZY_MODULES = (
    "accelerator",
    "checkpoint",
    "checkpointing",
    "comm",
    "config",
    "dataloader",
    "engine",
    "git_version_info",
    "launcher",
    "moe",
    "ops",
    "pipe",
    "runtime",
    "trainer_door",
    "utils",
    "zero",
    "zero_to_fp32",
)


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        return importlib.import_module(f"ds_compat.{name}")
    if name == "DeepSpeedEngine":
        return importlib.import_module("ds_compat.engine").DeepSpeedEngine
    if name == "DeepSpeedDataLoader":
        return importlib.import_module("ds_compat.dataloader").DeepSpeedDataLoader
    raise AttributeError(f"module 'ds_compat' has no attribute '{name}'")


def init_distributed(dist_backend: str | None = None, **kwargs: Any) -> None:
    """`deepspeed.init_distributed`: the default process group from the launcher's environment."""
    from ds_compat import comm

    comm.init_distributed(dist_backend=dist_backend, **kwargs)


def _add_core_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)",
    )
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument(
        "--deepscale",
        default=False,
        action="store_true",
        help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)",
    )
    group.add_argument(
        "--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file."
    )
    return parser


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's flags: --deepspeed, --deepspeed_config, --deepscale, --deepscale_config."""
    return _add_core_arguments(parser)


def _resolve_config(args: Any, config: Any, config_params: Any) -> Any:
    """The config source exactly as deepspeed.initialize picks it, with its assertion messages."""
    if config is None and config_params is not None:
        config = config_params
    if hasattr(args, "deepscale_config") and args.deepscale_config is not None:
        from glm45v_fsdp.log import get_logger

        get_logger().warning(
            "************ --deepscale_config is deprecated, please use --deepspeed_config ************"
        )
        if hasattr(args, "deepspeed_config"):
            assert args.deepspeed_config is None, (
                "Not sure how to proceed, we were given both a deepscale_config and deepspeed_config"
            )
        args.deepspeed_config = args.deepscale_config
        args.deepscale_config = None
    if hasattr(args, "deepspeed_config") and args.deepspeed_config is not None:
        assert config is None, (
            "Not sure how to proceed, we were given deepspeed configs in the deepspeed arguments and "
            "deepspeed.initialize() function call"
        )
        config = args.deepspeed_config
    assert config is not None, "DeepSpeed requires --deepspeed_config to specify configuration file"
    return config


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple[Any, Any, Any, Any]:
    """`deepspeed.initialize` on the FSDP2 core -> (engine, optimizer, training_dataloader, lr_scheduler).

    The config comes from `config`, else `config_params`, else `args.deepspeed_config` (`args.deepscale_config`,
    deprecated), with DeepSpeed's assertions when it is missing or given twice. It is translated by
    ds_compat.config (a UserError names any key the backend cannot honour). The model is sharded with FSDP2; a
    client optimizer built on its unsharded parameters is rebuilt on the sharded ones.
    """
    assert model is not None, "deepspeed.initialize requires a model"
    from ds_compat import comm
    from ds_compat.engine import DeepSpeedEngine

    comm.init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    config = _resolve_config(args, config, config_params)
    if mesh_param is not None:
        from glm45v_fsdp.errors import UserError

        raise UserError(
            "initialize(mesh_param=...) sets DeepSpeed's (data, sequence) parallel mesh; the FSDP2 backend builds its "
            "mesh from the ds_config (sequence parallelism is not supported yet). Remove mesh_param."
        )
    engine = DeepSpeedEngine(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        collate_fn=collate_fn,
        config=config,
    )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


__all__ = [
    "DeepSpeedEngine",
    "__version__",
    "add_config_arguments",
    "comm",
    "init_distributed",
    "initialize",
]
