"""`deepspeed.runtime.config`: DeepSpeedConfig, the parsed ds_config a script reads (batch triple, ZeRO, precision,
optimizer, scheduler, ...), built on the translator's pieces: ds_compat.config's loading (dict, JSON/hjson file or
base64, duplicate keys rejected) and batch arithmetic, ds_keys' removed-key table, and DeepSpeed's section models
(ds_compat/zero/config.py, ds_compat/runtime/precision_config.py).

It reads a config; it decides nothing about the FSDP2 run: `DeepSpeedConfig.translation()` (ds_compat.config.translate)
says what the engine does with it. Errors have DeepSpeed's classes: a batch triple DeepSpeed rejects is an
AssertionError (and a ConfigError), a removed key a DeepSpeedConfigError, a bad section pydantic's ValidationError.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import torch

from ds_compat import ds_keys
from ds_compat._common import DeepSpeedAssertion, as_int, key_error
from ds_compat.config import Translation, load_ds_config, resolve_batch, translate
from ds_compat.runtime.config_utils import logger
from ds_compat.runtime.precision_config import DeepSpeedFP16Config, get_bfloat16_config, get_float16_config
from ds_compat.sections import DEFAULT_GRADIENT_CLIPPING, DTYPE_NAMES
from ds_compat.zero.config import ZeroStageEnum, get_zero_config
from glm45v_fsdp.errors import ConfigError

DEEPSPEED_OPTIMIZERS = ["adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon"]
# attribute -> (top-level key, DeepSpeed's default): the values DeepSpeedConfig reads as they are
SCALARS: dict[str, tuple[str, Any]] = {
    "steps_per_print": ("steps_per_print", None),  # None: no progress line
    "gradient_clipping": ("gradient_clipping", DEFAULT_GRADIENT_CLIPPING),
    "prescale_gradients": ("prescale_gradients", False),
    "gradient_predivide_factor": ("gradient_predivide_factor", 1.0),
    "disable_allgather": ("disable_allgather", False),
    "dump_state": ("dump_state", False),
    "wall_clock_breakdown": ("wall_clock_breakdown", False),
    "memory_breakdown": ("memory_breakdown", False),
    "zero_allow_untested_optimizer": ("zero_allow_untested_optimizer", False),
    "zero_force_ds_cpu_optimizer": ("zero_force_ds_cpu_optimizer", True),
    "dataloader_drop_last": ("dataloader_drop_last", False),
    "managed_gradient_accumulation": ("managed_gradient_accumulation", True),
    "disable_python_gc": ("disable_python_gc", False),
    "log_level": ("log_level", None),
    "use_data_before_expert_parallel_": ("use_data_before_expert_parallelism", False),
}
# DeepSpeed's section objects for features the FSDP2 backend does not run (or runs its own way): DeepSpeedConfig
# does not build them. A script that reads one gets an AttributeError naming it.
SECTIONS_NOT_PROVIDED = frozenset(
    {
        "activation_checkpointing_config",
        "aio_config",
        "autotuning_config",
        "checkpoint_config",
        "comms_config",
        "compile_config",
        "data_efficiency_config",
        "datastates_config",
        "expert_parallel_config",
        "flops_profiler_config",
        "hybrid_engine",
        "monitor_config",
        "tensor_parallel_config",
        "timers_config",
        "weight_quantization_config",
    }
)
TAG_VALIDATION_MODES = ("IGNORE", "WARN", "FAIL")
PIPELINE_DEFAULTS = {
    "stages": "auto",
    "partition": "best",
    "seed_layers": False,
    "activation_checkpoint_interval": 0,
    "pipe_partitioned": True,
    "grad_partitioned": True,
}
COMMUNICATION_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
AUTOCAST_DTYPES = {  # DeepSpeed's DtypeEnum: the translator's spellings, the torch dtypes themselves, and int8
    **{name: COMMUNICATION_DTYPES[ours] for name, ours in DTYPE_NAMES.items()},
    **{dtype: dtype for dtype in COMMUNICATION_DTYPES.values()},
    **dict.fromkeys(("int8", "torch.int8", torch.int8), torch.int8),
}


class DeepSpeedConfigError(Exception):
    pass


def _communication_dtype(param_dict: dict, key: str, default: str | None) -> torch.dtype | None:
    value = param_dict.get(key, default)
    if value is None:
        return None  # follows the training precision
    dtype = COMMUNICATION_DTYPES.get(str(value).lower())
    if dtype is None:
        raise key_error(
            key, value, "is not a data type DeepSpeed communicates in", f"Write one of {list(COMMUNICATION_DTYPES)}."
        )
    return dtype


def _section(param_dict: dict, key: str) -> dict:
    node = param_dict.get(key, {})
    if not isinstance(node, dict):
        raise key_error(key, node, "is not a section", 'Write it as a JSON object, e.g. {"enabled": true}.')
    return node


def _gradient_allreduce_op(param_dict: dict, zero_config: Any) -> str:
    """ "mean" or "sum" (any case); "sum" refused where DeepSpeed refuses it: ZeRO-3, ZenFlow, DeepCompile."""
    op = param_dict.get("gradient_allreduce_op", "mean")
    op = op.lower() if isinstance(op, str) else op
    if op not in ("mean", "sum"):
        raise ConfigError(
            f"Invalid gradient_allreduce_op: DeepSpeed config key 'gradient_allreduce_op' = {op!r} is not a reduction "
            'DeepSpeed offers. Write "mean" or "sum".'
        )
    deepcompile = _section(param_dict, "compile").get("deepcompile", False)
    for refused, feature in (
        (zero_config.stage == ZeroStageEnum.weights, "ZeRO stage 3"),
        (zero_config.zenflow is not None, "ZenFlow"),
        (deepcompile, "DeepCompile"),
    ):
        if op == "sum" and refused:
            raise ConfigError(f"gradient_allreduce_op='sum' is not supported with {feature}: write \"mean\".")
    return op


def _autocast_dtype(autocast: dict) -> torch.dtype | None:
    if "dtype" not in autocast:
        return None
    value = autocast["dtype"]
    if value not in AUTOCAST_DTYPES:
        raise key_error("torch_autocast.dtype", value, "is not a dtype", 'Write "bf16", "fp16" or "fp32".')
    return AUTOCAST_DTYPES[value]


def _safe_modules(autocast: dict) -> list[str] | None:
    names = autocast.get("lower_precision_safe_modules")
    if names is not None and not all(isinstance(name, str) for name in names):
        raise key_error(
            "torch_autocast.lower_precision_safe_modules", names, "is not a list of names", 'Write ["torch.nn.Linear"].'
        )
    return names


class DeepSpeedConfig:
    """The ds_config `config` (a dict, a JSON/hjson path or base64 JSON) for this process's data-parallel size.

    The data-parallel size is `mpu.get_data_parallel_world_size()`, else the world size divided by
    `sequence_parallel_size`, from deepspeed.comm (1 before it is initialised), as in DeepSpeed.
    """

    def __init__(self, config: dict | str, mpu: Any = None, mesh_device: Any = None) -> None:
        self._param_dict = config if isinstance(config, dict) else load_ds_config(config)
        self._reject_removed_keys()
        self.global_rank, self.world_size = self._data_parallel_world(mpu, mesh_device)
        param_dict = copy.copy(self._param_dict)
        self._read(param_dict)
        try:
            batch = resolve_batch(param_dict, self.world_size)
        except ConfigError as error:  # DeepSpeed asserts on the batch arithmetic
            raise DeepSpeedAssertion(str(error)) from None
        self.train_batch_size = batch.train_batch_size
        self.train_micro_batch_size_per_gpu = batch.micro_batch_size
        self.gradient_accumulation_steps = batch.gradient_accumulation_steps
        self._check()

    def _reject_removed_keys(self) -> None:
        removed = [(key, why) for key, why in ds_keys.REMOVED_TOP_LEVEL.items() if key in self._param_dict]
        zero = self._param_dict.get("zero_optimization")
        if isinstance(zero, dict):
            removed += [(f"zero_optimization.{k}", why) for k, why in ds_keys.REMOVED_ZERO.items() if k in zero]
        if removed:
            key, why = removed[0]
            raise DeepSpeedConfigError(f"DeepSpeed config key '{key}': {why}. Remove it.")

    def _data_parallel_world(self, mpu: Any, mesh_device: Any) -> tuple[int, int]:
        from ds_compat import comm

        if not comm.is_initialized():
            return 0, 1
        world = comm.get_world_size()
        if mpu is not None:
            if hasattr(mpu, "get_data_parallel_world_size"):
                return comm.get_rank(), mpu.get_data_parallel_world_size()
            return comm.get_rank(), self._divide(world, mpu.get_sequence_parallel_world_size())
        if mesh_device is not None:
            return comm.get_rank(), comm.get_world_size(mesh_device.get_group(mesh_dim="data_parallel"))
        sequence_parallel = self._param_dict.get("sequence_parallel_size")
        sequence_parallel = 1 if sequence_parallel is None else as_int("sequence_parallel_size", sequence_parallel, 1)
        return comm.get_rank(), self._divide(world, sequence_parallel)

    @staticmethod
    def _divide(world: int, sequence_parallel: int) -> int:
        if world % sequence_parallel:
            raise DeepSpeedConfigError(
                f"DeepSpeed config key 'sequence_parallel_size' = {sequence_parallel} does not divide the world size "
                f"{world}, so the data-parallel size is not a whole number. Choose a divisor of {world}."
            )
        return world // sequence_parallel

    def _read(self, param_dict: dict) -> None:
        for attribute, (key, default) in SCALARS.items():
            setattr(self, attribute, param_dict.get(key, default))
        self.communication_data_type = _communication_dtype(param_dict, "communication_data_type", None)
        self.seq_parallel_communication_data_type = _communication_dtype(
            param_dict, "seq_parallel_communication_data_type", "fp32"
        )
        self.zero_config = get_zero_config(param_dict)
        self.zero_optimization_stage = self.zero_config.stage
        self.zero_enabled = self.zero_optimization_stage > 0
        self.float16_config = get_float16_config(param_dict)
        self.bfloat16_config = get_bfloat16_config(param_dict)
        optimizer = _section(param_dict, "optimizer")
        name = optimizer.get("type")
        self.optimizer_name = name.lower() if isinstance(name, str) and name.lower() in DEEPSPEED_OPTIMIZERS else name
        self.optimizer_params = optimizer.get("params") if name is not None else None
        self.optimizer_legacy_fusion = optimizer.get("legacy_fusion", False)
        scheduler = _section(param_dict, "scheduler")
        self.scheduler_name = scheduler.get("type")
        self.scheduler_params = scheduler.get("params") if self.scheduler_name is not None else None
        self.gradient_allreduce_op = _gradient_allreduce_op(param_dict, self.zero_config)
        autocast = _section(param_dict, "torch_autocast")
        self.torch_autocast_enabled = autocast.get("enabled", False)
        self.torch_autocast_dtype = _autocast_dtype(autocast)
        self.torch_autocast_lower_precision_safe_modules = _safe_modules(autocast)
        self._read_checkpoint(_section(param_dict, "checkpoint"))
        data_types = _section(param_dict, "data_types")
        self.grad_accum_dtype = data_types.get("grad_accum_dtype")
        self.param_dtype = data_types.get("param_dtype")
        self.buffer_dtype = data_types.get("buffer_dtype")
        self.keep_in_fp32_modules = data_types.get("keep_in_fp32_modules", "auto")
        if self.keep_in_fp32_modules != "auto" and not (
            isinstance(self.keep_in_fp32_modules, list) and all(isinstance(n, str) for n in self.keep_in_fp32_modules)
        ):
            raise DeepSpeedConfigError(
                f"DeepSpeed config key 'data_types.keep_in_fp32_modules' = {self.keep_in_fp32_modules!r} is neither "
                '"auto" nor a list of module-name patterns. Write "auto" or e.g. ["lm_head"].'
            )
        self.data_efficiency_enabled = _section(param_dict, "data_efficiency").get("enabled", False)
        self.pipeline = {**PIPELINE_DEFAULTS, **_section(param_dict, "pipeline")}

    def _read_checkpoint(self, checkpoint: dict) -> None:
        mode = str(checkpoint.get("tag_validation", "WARN")).upper()
        if mode not in TAG_VALIDATION_MODES:
            raise DeepSpeedConfigError(
                f"DeepSpeed config key 'checkpoint.tag_validation' = {mode!r} is not a validation mode. Write one of "
                f"{list(TAG_VALIDATION_MODES)}."
            )
        self.checkpoint_tag_validation_enabled = mode != "IGNORE"
        self.checkpoint_tag_validation_fail = mode == "FAIL"
        self.load_universal_checkpoint = checkpoint.get("load_universal", False)
        self.use_node_local_storage = checkpoint.get("use_node_local_storage", False)
        pipeline_write = checkpoint.get("parallel_write", {}).get("pipeline_stage", False)
        if not isinstance(pipeline_write, bool):
            raise DeepSpeedConfigError(
                f"DeepSpeed config key 'checkpoint.parallel_write.pipeline_stage' = {pipeline_write!r} is not a "
                "boolean. Write true or false."
            )
        self.checkpoint_parallel_write_pipeline = pipeline_write

    def _check(self) -> None:
        if self.float16_config.enabled and self.bfloat16_config.enabled:
            raise DeepSpeedAssertion(
                "bfloat16 and fp16 modes cannot be simultaneously enabled. Set one of fp16.enabled / bf16.enabled "
                "to false."
            )
        master = [
            ("fp16.fp16_master_weights_and_grads", self.float16_config.fp16_master_weights_and_grads),
            ("bf16.bf16_master_weights_and_grads", self.bfloat16_config.bf16_master_weights_and_grads),
            ("bf16.bf16_optimizer_states", self.bfloat16_config.bf16_optimizer_states),
        ]
        for key, enabled in master:
            if enabled and self.zero_optimization_stage == ZeroStageEnum.disabled:
                raise DeepSpeedAssertion(f"{key} is only supported with ZeRO Stage 1, 2, or 3. Set zero_optimization.")
        if self.bfloat16_config.bf16_optimizer_states and not self.bfloat16_config.bf16_master_weights_and_grads:
            raise DeepSpeedAssertion("bf16_optimizer_states requires bf16_master_weights_and_grads to be enabled.")

    # The pre-0.18 attributes scripts still read, with that DeepSpeed's answers: the fp16 values when fp16 is on,
    # no scaling (1) under bf16, DeepSpeed's fp16 defaults otherwise; loss-scaler arguments only when the fp16
    # section sets one of them.
    @property
    def fp16_enabled(self) -> bool:
        return self.float16_config.enabled

    @property
    def bfloat16_enabled(self) -> bool:
        return self.bfloat16_config.enabled

    @property
    def fp16_auto_cast(self) -> bool | None:
        return self.float16_config.auto_cast if self.fp16_enabled else None

    @property
    def loss_scale(self) -> float:
        if self.fp16_enabled:
            return self.float16_config.loss_scale
        return 1.0 if self.bfloat16_enabled else DeepSpeedFP16Config().loss_scale

    @property
    def initial_dynamic_scale(self) -> int:
        if self.fp16_enabled:
            return self.float16_config.initial_dynamic_scale()
        return 1 if self.bfloat16_enabled else DeepSpeedFP16Config().initial_dynamic_scale()

    @property
    def dynamic_loss_scale_args(self) -> dict | None:
        fp16 = self._param_dict.get("fp16")
        scaling_keys = {
            "initial_scale_power",
            "loss_scale_window",
            "min_loss_scale",
            "hysteresis",
            "consecutive_hysteresis",
        }
        if not self.fp16_enabled or not scaling_keys & set(fp16):
            return None
        return self.float16_config.dynamic_loss_scale_args()

    def translation(self, world_size: int | None = None) -> Translation:
        """What the FSDP2 engine does with this config on `world_size` ranks (default: this process's world)."""
        from ds_compat import comm

        if world_size is None:
            world_size = comm.get_world_size() if comm.is_initialized() else self.world_size
        return translate(self._param_dict, world_size)

    def print_user_config(self) -> None:
        logger.info("  json = " + json.dumps(self._param_dict, sort_keys=True, indent=4, default=str))

    def print(self, name: str) -> None:
        logger.info(f"{name}:")
        for attribute in sorted(vars(self)):
            if attribute != "_param_dict":
                logger.info(f"  {attribute} {'.' * (29 - len(attribute))} {getattr(self, attribute)}")
        self.print_user_config()


class DeepSpeedConfigWriter:
    """Build a ds_config by hand and write it as JSON."""

    def __init__(self, data: dict | None = None) -> None:
        self.data = data if data is not None else {}

    def add_config(self, key: str, value: Any) -> None:
        self.data[key] = value

    def load_config(self, filename: str) -> None:
        self.data = load_ds_config(filename)

    def write_config(self, filename: str) -> None:
        with open(filename, "w") as out:
            json.dump(self.data, out)
