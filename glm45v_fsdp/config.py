"""One typed schema for a training run: YAML file, then `key.path=value` overrides, then validation.

Everything a run reads is here, in five sections: `model`, `data`, `parallel`, `features`, `training`.
Unknown keys, wrong types and impossible values fail before any model is built, naming the key and the closest
valid key. Checks that need the world size (parallel sizes dividing it) run in `validate_layout`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from glm45v_fsdp.errors import ConfigError, UserError
from glm45v_fsdp.op_names import check_ops_setting

DTypeName = Literal["bf16", "fp16", "fp32"]


TEXT_ATTENTION = [
    f"model.language_model.layers.{{*}}.self_attn.{name}" for name in ("q_proj", "k_proj", "v_proj", "o_proj")
]


@dataclass
class LoraConfig:
    # The adapters' rank r; 0: no LoRA (full fine-tuning). Each adapted weight W [out, in] computes
    # x W^T + (alpha / r) * (dropout(x) A^T) B^T with A [r, in], B [out, r] (PEFT's LoRA); the base is frozen.
    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    # Module patterns (as every plan's) of the nn.Linear layers that get adapters: attention, dense and shared-expert
    # MLP linears (...mlp.gate_proj, ...mlp.shared_experts.down_proj), the vision tower's (model.visual.blocks.{*}...).
    target_modules: list[str] = field(default_factory=lambda: list(TEXT_ATTENTION))
    # The routed experts' stacks gate_up_proj and down_proj get adapters too (per expert, a grouped GEMM; under
    # expert parallelism each rank holds its own experts' adapters); no dropout then.
    experts: bool = False
    # Module patterns trained in full beside the adapters (e.g. lm_head).
    modules_to_save: list[str] = field(default_factory=list)
    # The frozen base parameters are stored in parallel.fsdp_plan.param_dtype (bf16: half the bytes of the fp32
    # master copies full fine-tuning keeps, which a weight that never updates does not need); the adapters stay fp32.
    # false: the base in fp32 too. With param_dtype fp32 both are the same.
    frozen_in_compute_dtype: bool = True
    # A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) whose values the adapters start
    # from; it must hold exactly the adapters the keys above describe. null: A kaiming-uniform, B zeros (PEFT's).
    init_from: str | None = None


@dataclass
class ModelConfig:
    # Built-in architecture when name_or_path is null: the embedded tiny model or the published GLM-4.5V dims.
    preset: Literal["tiny", "glm-4.5v"] = "tiny"
    # Local HF model directory holding config.json (and tokenizer/processor files); overrides `preset`.
    name_or_path: str | None = None
    # Nested dict merged onto the HF config, e.g. {text_config: {vocab_size: 65536}}.
    config_overrides: dict[str, Any] = field(default_factory=dict)
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    # Which kernel each op runs (glm45v_fsdp/ops): auto (the fastest verified one per device), reference
    # (transformers' own modules everywhere), or {op: auto | reference | name} for rms_norm, rotary, attention,
    # experts, permute, swiglu. The log names what each op runs on.
    ops: str | dict[str, str] = "auto"
    # Module patterns whose parameters get requires_grad=False, e.g. model.visual.blocks.{*}.
    freeze: list[str] = field(default_factory=list)
    # Test and benchmark knob (keep 0 for real training): adds router_skew x (E-1-e)/(E-1) to expert e's selection
    # score, so the low-numbered experts (and the EP ranks that own them) get most tokens. Routing weights are
    # unchanged; only which experts are chosen.
    router_skew: float = 0.0
    # LoRA fine-tuning (docs/lora.md): rank 0 is off.
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class MixtureSourceConfig:
    """One source of data.mixture (docs/data.md#mixtures)."""

    # The source's format, as data.dataset: synthetic (data.synthetic_* keys), json or hf (data.image_root and
    # data.hf_split apply to every file source).
    dataset: Literal["synthetic", "json", "hf"] = "synthetic"
    data_path: str | None = None
    # Share of the sample stream; the weights are normalised over the list (3 and 1: 75% / 25%).
    weight: float = 1.0
    # Use only the source's first max_samples samples (after bad records are dropped); null: all of them.
    max_samples: int | None = None
    # The name in the metrics (data/<name>/...) and the checkpoint; null: "synthetic" or the file's stem.
    name: str | None = None


@dataclass
class DataConfig:
    dataset: Literal["synthetic", "json", "hf"] = "synthetic"
    # dataset=json: a LLaVA / ShareGPT-style .json or .jsonl file. dataset=hf: a local Hugging Face `datasets` data set
    # with the same record columns (a save_to_disk directory, a .parquet file or directory, an .arrow file or
    # directory; never downloaded).
    data_path: str | None = None
    # Directory image and video paths in the records are relative to (default: the data file's directory; for
    # dataset=hf and a directory, that directory).
    image_root: str | None = None
    # dataset=hf: the split taken from a data set with splits (a saved DatasetDict, parquet files named by split).
    hf_split: str = "train"
    cutoff_len: int = 1024
    packing: bool = False
    shuffle: bool = True
    num_workers: int = 0
    synthetic_samples: int = 256
    synthetic_text_tokens: int = 64
    synthetic_images_per_sample: int = 1
    synthetic_image_size: int = 56
    # Every sample i with i % synthetic_video_every == synthetic_video_every - 1 also holds a short synthetic video (a
    # shape moving over synthetic_video_frames frames at 2 fps), so the default run trains the video path; 0: none.
    synthetic_video_every: int = 4
    synthetic_video_frames: int = 4
    # Videos (records' "videos"): frames sampled at video_fps per second of the stream (transformers'
    # Glm4vVideoProcessor default, 2), at most video_max_frames of them (chosen evenly; LLaMA-Factory's video_maxlen
    # default, 128), each frame downscaled to at most video_max_pixels (LLaMA-Factory's default, 256 x 256). A video
    # longer than video_max_seconds, or whose decode takes longer than video_decode_timeout_s, is a bad record.
    video_fps: float = 2.0
    video_max_frames: int = 128
    video_max_pixels: int = 65_536
    video_max_seconds: float = 3600.0
    video_decode_timeout_s: float = 60.0
    # A record that cannot be trained on (broken structure, an unreadable, truncated, empty or oversized image,
    # nothing supervised after truncation), found when the data set is built: stop names the first one before
    # step 1; skip trains without every such record and logs each (their count is in the log and the summary).
    on_bad_record: Literal["stop", "skip"] = "stop"
    # The largest image decoded at all (width x height, after JPEG's reduced-scale decoding); every image is then
    # downscaled to the image processor's pixel budget. Larger images are bad records. Default: PIL's bomb limit.
    max_image_pixels: int = 89_478_485
    # Weighted sources ({dataset, data_path, weight, max_samples, name} each) instead of data.dataset /
    # data.data_path; docs/data.md#mixtures. null: data.dataset alone.
    mixture: list[MixtureSourceConfig] | None = None
    # Resume a checkpoint whose mixture differs from data.mixture (sources matched by name continue where they
    # were; the blend restarts with the new weights). false: a changed mixture stops the resume.
    mixture_allow_change: bool = False
    # Validation data (docs/training.md#validation), one of two: a file or directory in data.dataset's format, read
    # like data.data_path (data.image_root, data.hf_split, data.on_bad_record and cutoff_len apply to it too) ...
    validation_path: str | None = None
    # ... or this fraction of the training data, chosen with training.seed and held out (training excludes it); 0: none.
    validation_split: float = 0.0


@dataclass
class FsdpPlanConfig:
    # `model.visual` must be planned (the loss runs it before `model`: a unit of its own unless only the root encloses
    # it); `model` and `lm_head` as units
    # keep the embeddings and the output layer sharded outside their use.
    apply_modules: list[str] = field(
        default_factory=lambda: [
            "model.visual.blocks.{*}",
            "model.language_model.layers.{*}",
            "model.visual",
            "model",
            "lm_head",
        ]
    )
    param_dtype: DTypeName = "bf16"
    reduce_dtype: DTypeName = "fp32"
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    # Consecutive modules of one pattern are merged into one FSDP2 unit until it holds at least this many MiB of
    # parameters (fewer, larger collectives); modules that cannot fill a unit stay with the enclosing unit (the root
    # at the latest); 0: one unit per matched module; null: the device's default (parallel/fsdp.py UNIT_MIB_DEFAULT).
    unit_mib: float | None = None
    # Explicit FSDP2 prefetch: each unit of a pattern gathers the next N units of that pattern at its forward and
    # the previous N at its backward; 0: FSDP2's implicit prefetch (one unit ahead in backward only).
    prefetch: int = 0


@dataclass
class EpPlanConfig:
    # Module patterns of the MoE experts split over the ep ranks (each must be our MoE block's `experts`).
    apply_modules: list[str] = field(default_factory=lambda: ["model.language_model.layers.{*}.mlp.experts"])
    # alltoall: send each (token, expert) pair to the rank owning the expert, variable-size all-to-all both ways;
    # allgather: every rank gathers all tokens of its EP group, runs its own experts, reduce-scatters the sum.
    dispatcher: Literal["alltoall", "allgather"] = "alltoall"


@dataclass
class ParallelConfig:
    # World = dp_replicate x dp_shard x cp; dp_shard is derived from the world size.
    data_parallel_replicate_size: int = 1
    ulysses_parallel_size: int = 1
    ring_attention_size: int = 1
    # Ranks the routed experts are split over (E/ep whole experts each); divides dp_shard x cp and the expert count.
    expert_parallel_size: int = 1
    ep_plan: EpPlanConfig = field(default_factory=EpPlanConfig)
    fsdp_plan: FsdpPlanConfig = field(default_factory=FsdpPlanConfig)


@dataclass
class ChunkLossConfig:
    # off: full [tokens, vocab] logits; static: chunk_size rows per chunk; dynamic: chosen per batch from a budget.
    mode: Literal["off", "static", "dynamic"] = "off"
    chunk_size: int = 1024
    # dynamic: at most this many rows per chunk; when null, as many rows as fit logits_budget_mib of fp32 logits.
    total_chunk_size: int | None = None
    logits_budget_mib: float = 256.0


@dataclass
class RecomputeConfig:
    enabled: bool = False
    apply_modules: list[str] = field(
        default_factory=lambda: ["model.visual.blocks.{*}", "model.language_model.layers.{*}"]
    )
    # full: keep nothing inside a module; selective: keep matmul / attention / router top-k outputs.
    granularity: Literal["full", "selective"] = "full"
    # full: also keep the attention kernels' outputs (output + log-sum-exp: O(tokens) bytes), so backward does not
    # run the O(tokens^2) attention forward again; false = keep nothing but each module's inputs. The reentrant
    # variant cannot keep anything inside a module, so this key does not apply to it.
    keep_attention: bool = True
    use_reentrant: bool = False


@dataclass
class ActivationOffloadConfig:
    enabled: bool = False
    apply_modules: list[str] = field(
        default_factory=lambda: ["model.visual.blocks.{*}", "model.language_model.layers.{*}"]
    )
    # Saved tensors smaller than this stay on the device: below ~1 MiB a copy's fixed cost (launch, event, pinned
    # allocation) outweighs the bytes it frees, and the large activations (hidden states, attention and MoE buffers
    # of multi-MiB each at real sizes) carry nearly all the memory.
    min_tensor_bytes: int = 1 << 20


@dataclass
class EpBalanceConfig:
    """Even the EP ranks' token load by running the hottest experts' surplus tokens on replicas (alltoall only)."""

    enabled: bool = False
    # Replica slots per rank and MoE layer: experts a rank may run for their owners in one forward.
    max_dup_experts_num: int = 1
    # Balance a layer's forward only when its busiest rank's load exceeds the mean by this factor; below it the
    # forward runs exactly as without balance (nothing copied). Re-planned every forward from its own counts. 1.2:
    # below it the saving did not pay for the replicas' weight exchange (docs/expert_parallel.md).
    trigger_max_over_mean: float = 1.2
    # Stop moving tokens once the busiest rank is within this factor of the mean.
    target_max_over_mean: float = 1.02


@dataclass
class RouterConfig:
    """MoE router balancing (glm45v_fsdp/model/router_health.py); the router figures are recorded either way."""

    # Aux-loss-free balancing (DeepSeek-V3, GLM-4.5): after every optimizer step each MoE layer's
    # e_score_correction_bias[i] += rate x sign(mean load - load[i]), from the step's expert load over all ranks.
    # 0 = off, the default for fine-tuning (the pre-trained bias is kept); DeepSeek-V3 pre-trained with 1e-3.
    bias_update_rate: float = 0.0
    # Weight of the auxiliary balance loss added to the training loss; 0 = off.
    aux_loss_coef: float = 0.0
    # sequence: DeepSeek-V3's complementary sequence-wise balance loss, per MoE layer and sequence (packed segments
    # count as sequences); transformers: the loss transformers' GLM-4.5V adds with output_router_logits=True
    # (Switch-Transformer style: softmax of the router logits, pooled over the MoE layers and the micro batch).
    aux_loss_type: Literal["sequence", "transformers"] = "sequence"


@dataclass
class FeaturesConfig:
    """Memory and speed switches."""

    chunk_loss: ChunkLossConfig = field(default_factory=ChunkLossConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    activation_offload: ActivationOffloadConfig = field(default_factory=ActivationOffloadConfig)
    ep_balance: EpBalanceConfig = field(default_factory=EpBalanceConfig)
    router: RouterConfig = field(default_factory=RouterConfig)


@dataclass
class LossScaleConfig:
    """fp16 loss scaling (used only with parallel.fsdp_plan.param_dtype=fp16), DeepSpeed's fp16 section's rules."""

    # 0 = dynamic scaling; > 0 = this fixed scale.
    static_scale: float = 0.0
    initial_scale_power: int = 16
    # Good steps before the scale doubles.
    window: int = 1000
    # Overflows tolerated before the scale halves.
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0


@dataclass
class TrainingConfig:
    train_iters: int = 100
    micro_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_scheduler: Literal["constant", "linear", "cosine"] = "cosine"
    lr_warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    # Max global grad norm; 0 disables clipping.
    clip_grad: float = 1.0
    loss_type: Literal["default", "per_token"] = "default"
    # What a NaN/inf loss or grad norm does: skip the optimizer step and count it, or stop the run.
    on_nonfinite: Literal["skip", "stop"] = "skip"
    max_skipped_steps: int = 10
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    seed: int = 1234
    deterministic: bool = False
    device: Literal["auto", "npu", "cuda", "cpu"] = "auto"
    # Fast failure (runtime/watchdog.py): a rank silent this long (killed, out of memory, node lost) ends the job;
    # a rank that fails with an error ends it at once. 0 = off (the process-group timeout, 30 min, applies).
    peer_timeout_s: float = 30.0
    # A stuck job (runtime/stuck.py): no step finished for this long ends every rank (exit 5) after each dumps its
    # stacks and last collectives and rank 0 names the ranks behind. null: max(600 s, 20 x the median step after
    # the first 3); 0 = off.
    step_timeout_s: float | None = None
    output_dir: str = "output/glm45v_tiny"
    log_interval: int = 1
    progress_bar: bool = True
    # Peak-memory tracking; null = on for npu/cuda (allocator peak), off on cpu (tracked tensor storages).
    track_memory: bool | None = None
    tensorboard: bool = False
    # First step of the summary's stats window; 0 = skip the first 10% of steps (at least one).
    stats_start_step: int = 0
    # Weights / checkpoint to start from: an HF model directory (safetensors), a DCP save directory (its latest
    # complete checkpoint), one DCP checkpoint, or a DeepSpeed save directory / global_stepN directory (resumed:
    # weights, Adam moments, step, schedule). null = initialise from scratch (the log says so).
    load: str | None = None
    load_format: Literal["auto", "hf", "dcp", "deepspeed"] = "auto"
    # auto: when training.save holds a complete checkpoint, continue from its latest (weights, optimizer, step,
    # data position, RNG) instead of training.load, so a restarted job (torchrun --max-restarts, Slurm --requeue,
    # a Kubernetes restart) runs on with the same command; off: training.load decides.
    resume: Literal["off", "auto"] = "off"
    # Missing, unexpected or shape-mismatched keys stop the run before step 1.
    load_strict: bool = True
    no_load_optim: bool = False
    no_load_rng: bool = False
    # DCP save directory; a checkpoint every save_interval steps (0 = only at the end), the last save_keep_last kept
    # (0 = all), optionally written in the background.
    save: str | None = None
    save_interval: int = 0
    save_keep_last: int = 0
    async_save: bool = False
    # Also export the final weights to this directory as HF safetensors (per-expert layout, loadable by transformers).
    save_hf: str | None = None
    # Write the first N micro batches of each rank to <output_dir>/batches/rank{R}_micro{K}.pt.
    dump_batches: int = 0
    # Validation (data.validation_path or data.validation_split): an eval every eval_interval steps and after the
    # last step; 0 = after the last step only.
    eval_interval: int = 0
    # Global eval batches (micro_batch_size samples per data-parallel rank) per eval, from the validation set's
    # start, the same ones every eval; 0 = the whole validation set.
    eval_iters: int = 0
    # Also save a checkpoint after each eval that lowers the run's best eval loss, named in <training.save>/best and
    # never pruned by save_keep_last (needs training.save and validation data).
    save_best: bool = False
    # [first, last]: profile these steps with torch.profiler on every rank and write each rank's communication
    # figures to <output_dir>/profile/rank{R}.json (runtime/profiling.py); null = no profiler.
    profile_steps: list[int] | None = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)


# --------------------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------------------

CONFIG_DIR_ENV = "GLM45V_FSDP_CONFIG_DIR"
DEFAULT_CONFIG_NAME = "glm45v_tiny.yaml"


def packaged_config_dir() -> Path:
    """`configs/` of the source tree, or the copy installed inside the package (glm45v_fsdp.configs)."""
    source_tree = Path(__file__).resolve().parent.parent / "configs"
    if (source_tree / DEFAULT_CONFIG_NAME).is_file():
        return source_tree
    return Path(__file__).resolve().parent / "configs"


def default_config_path() -> Path:
    """configs/glm45v_tiny.yaml: what every entry point runs without --config."""
    return packaged_config_dir() / DEFAULT_CONFIG_NAME


def packaged_config_names() -> list[str]:
    return sorted(path.stem for path in packaged_config_dir().glob("*.yaml"))


def resolve_config_path(name: str | Path | None) -> Path:
    """--config: an existing file, else the name of a shipped config (`glm45v_106b_sft` or `glm45v_106b_sft.yaml`),
    so the packaged configs work from any directory; None is the default config."""
    if name is None:
        return default_config_path()
    path = Path(name).expanduser()
    if path.is_file():
        return path
    packaged = packaged_config_dir() / (path.name if path.suffix == ".yaml" else f"{path.name}.yaml")
    if path.parent == Path(".") and packaged.is_file():
        return packaged
    raise UserError(
        f"Config file '{name}' does not exist. Pass an existing YAML file with --config, or the name of a shipped "
        f"config: {', '.join(packaged_config_names())}."
    )


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        keys.append(path)
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(_all_keys(hints[f.name], path + "."))
    return keys


ALL_KEYS: list[str] = _all_keys(Config)


def closest_keys(key: str, candidates: list[str], limit: int = 3, cutoff: float = 0.5) -> str:
    """ " Did you mean 'a'? Also close: 'b', 'c'." for the few candidates closest to `key`, or ""."""
    close = difflib.get_close_matches(key, candidates, n=limit, cutoff=cutoff)
    if not close:
        return ""
    others = [k for k in close[1:] if difflib.SequenceMatcher(None, key, k).ratio() >= 0.8]
    also = f" Also close: {', '.join(repr(k) for k in others)}." if others else ""
    return f" Did you mean '{close[0]}'?{also}"


LEAF_KEYS: list[str] = [key for key in ALL_KEYS if not any(other.startswith(f"{key}.") for other in ALL_KEYS)]


def _unknown_key_error(path: str, valid_here: list[str]) -> ConfigError:
    hint = closest_keys(path, sorted(set(LEAF_KEYS) | set(valid_here)))
    if not hint:
        leaf = path.rsplit(".", 1)[-1]
        same_leaf = [key for key in ALL_KEYS if key.rsplit(".", 1)[-1] == leaf][:1]
        hint = f" Did you mean '{same_leaf[0]}'?" if same_leaf else ""
    if not hint:
        section = path.rsplit(".", 1)[0] if "." in path else "the top level"
        hint = f" '{section}' has {len(valid_here)} key(s), none of them close."
    return ConfigError(f"Unknown config key '{path}'.{hint} docs/config.md lists every key.")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping {" + ", ".join(f.name for f in dataclasses.fields(tp)) + "}"
    if origin is list and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        return "a list of mappings {" + ", ".join(f.name for f in dataclasses.fields(typing.get_args(tp)[0])) + "}"
    if origin is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(tp):
            try:
                return _coerce(value, option, path)
            except ConfigError:
                if isinstance(value, list) and typing.get_origin(option) is list:
                    raise  # a list's own error names the bad item (data.mixture[1].weight)
        raise _type_error(value, tp, path)
    if tp is type(None):
        if value is None:
            return None
        raise _type_error(value, tp, path)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices and type(value) is type(choices[choices.index(value)]):
            return value
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"Config key '{path}' = {value!r} is not one of {list(choices)}.{hint}")
    if origin is list:
        if not isinstance(value, list):
            raise _type_error(value, tp, path)
        (item_type,) = typing.get_args(tp)
        if dataclasses.is_dataclass(item_type):  # a list of sections (data.mixture)
            for i, item in enumerate(value):
                if not isinstance(item, dict):
                    raise ConfigError(
                        f"Config key '{path}[{i}]' = {item!r} is not a mapping: each item is {_type_name(item_type)}."
                    )
            return [_build(item_type, item, f"{path}[{i}].") for i, item in enumerate(value)]
        return [_coerce(item, item_type, f"{path}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _type_error(value, tp, path)
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in YAML_BOOL_WORDS:  # YAML 1.1 habits: `enabled: yes`
            return YAML_BOOL_WORDS[value.lower()]
        raise _type_error(value, tp, path)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(value, tp, path)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _type_error(value, tp, path)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(value, tp, path)
    raise AssertionError(f"unsupported annotation {tp} at {path}")


def _type_error(value: Any, tp: Any, path: str) -> ConfigError:
    return ConfigError(
        f"Config key '{path}' expects {_type_name(tp)}, got {value!r} ({type(value).__name__}). "
        f"Fix the value in the YAML file or the command-line override."
    )


def _build(cls: type, data: Any, prefix: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"Config section '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}.")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in names:
            raise _unknown_key_error(path, [f"{prefix}{n}" for n in names] or ["(none yet)"])
        tp = hints[key]
        kwargs[key] = _build(tp, value, path + ".") if dataclasses.is_dataclass(tp) else _coerce(value, tp, path)
    return cls(**kwargs)


def _split_flow_list(text: str) -> list[str]:
    """Split `[a, b.{0-3,5}, c]` on top-level commas (braces of module patterns keep theirs)."""
    items, depth, current = [], 0, ""
    for char in text.strip()[1:-1]:
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        items.append(current.strip())
    return items


class YamlLoader(yaml.SafeLoader):
    """YAML with the scalars of YAML 1.2's core schema, for config files and command-line values alike.

    PyYAML follows YAML 1.1, where `off`, `on`, `yes` and `no` are booleans (so `mode: off`, a documented value of
    features.chunk_loss.mode, arrived as False) and `1e-4` is a string (no dot). Here only true/false are booleans and
    `1e-4` is a float; a bool key still accepts yes/no/on/off (see `_coerce`).
    """


_BOOL_TAG, _FLOAT_TAG = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"
YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag not in (_BOOL_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
YamlLoader.add_implicit_resolver(_BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
YamlLoader.add_implicit_resolver(
    _FLOAT_TAG,
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)
YAML_BOOL_WORDS = {"yes": True, "on": True, "no": False, "off": False}


def yaml_load(text: str) -> Any:
    """`text` parsed with YamlLoader (YAML 1.2 scalars)."""
    return yaml.load(text, Loader=YamlLoader)  # noqa: S506 - YamlLoader is a SafeLoader


def parse_override_value(text: str) -> Any:
    """Command-line values are read as YAML scalars or flow lists: `3`, `1e-4`, `true`, `null`, `off`, `[a, b]`.

    A list whose items YAML cannot read (module patterns with `{0-3,5}`) is split by hand.
    """
    try:
        return yaml_load(text) if text != "" else ""
    except yaml.YAMLError:
        if text.strip().startswith("[") and text.strip().endswith("]"):
            return [parse_override_value(item) for item in _split_flow_list(text)]
        return text


def _set_path(tree: dict, path: str, raw: str) -> None:
    parts = path.split(".")
    node = tree
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"Override '{path}={raw}': '{'.'.join(parts[: depth + 1])}' is a value, not a section.")
        node = child
    node[parts[-1]] = _override_value_for(path, raw)


def _override_value_for(path: str, raw: str) -> Any:
    """Parse an override value; keep the literal text where the schema expects a string (e.g. a path `007`)."""
    value = parse_override_value(raw)
    field_type = _field_type(path)
    if field_type is str or (
        typing.get_origin(field_type) in (typing.Union, types.UnionType) and str in typing.get_args(field_type)
    ):
        options = typing.get_args(field_type)
        takes_value = any(
            isinstance(value, typing.get_origin(option) or option) for option in options if option is not str
        )
        if value is not None and not isinstance(value, str) and not takes_value:
            return raw
    return value


def _field_type(path: str) -> Any:
    cls: Any = Config
    for part in path.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return None
        cls = hints[part]
    return cls


def deep_merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_yaml(path: str | Path | None) -> dict:
    """The mapping of sections in config file `path` (resolved by `resolve_config_path`)."""
    path = resolve_config_path(path)
    try:
        data = yaml_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise UserError(f"Config file '{path}' is not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"Config file '{path}' must hold a mapping of sections, got {type(data).__name__}.")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """YAML (default: configs/glm45v_tiny.yaml) + `key.path=value` overrides -> validated Config."""
    tree = read_yaml(path)
    override_tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"Override '{item}' has no '='. Write overrides as key.path=value, e.g. training.lr=1e-4."
            )
        key, raw = item.split("=", 1)
        key = key.strip()
        if key.startswith("--"):
            key = key[2:]
        if not key:
            raise ConfigError(f"Override '{item}' has an empty key. Write key.path=value.")
        _set_path(override_tree, key, raw)
    config = _build(Config, deep_merge(tree, override_tree), "")
    validate(config)
    return config


def config_from_dict(tree: dict) -> Config:
    config = _build(Config, tree, "")
    validate(config)
    return config


def set_fields(tree: dict, fields: Mapping[str, Any]) -> dict:
    """`tree` (a config as `to_dict` gives it) with typed values set by key path, e.g.
    {"parallel.expert_parallel_size": 2}: what a translation decides, applied without a round trip through text."""
    for path, value in fields.items():
        *parents, leaf = path.split(".")
        node = tree
        for part in parents:
            node = node[part]
        node[leaf] = value
    return tree


# --------------------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------------------


def _require(condition: bool, key: str, value: Any, need: str) -> None:
    if not condition:
        raise ConfigError(f"Config key '{key}' = {value!r} is invalid: it must be {need}.")


def _validate_lora(config: Config) -> None:
    lora = config.model.lora
    _require(lora.rank >= 0, "model.lora.rank", lora.rank, "an integer >= 0 (0: no LoRA)")
    if lora.rank == 0:
        return
    _require(lora.alpha > 0, "model.lora.alpha", lora.alpha, "> 0")
    _require(0 <= lora.dropout < 1, "model.lora.dropout", lora.dropout, "in [0, 1)")
    _require(
        bool(lora.target_modules) or lora.experts,
        "model.lora.target_modules",
        lora.target_modules,
        "a non-empty list of patterns, unless model.lora.experts=true",
    )
    if config.model.freeze:
        raise ConfigError(
            f"Config key 'model.freeze' = {config.model.freeze!r} with model.lora.rank={lora.rank}: LoRA freezes "
            f"every base parameter already (only the adapters and model.lora.modules_to_save train). Remove "
            f"model.freeze."
        )


MIXTURE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def mixture_names(sources: list[MixtureSourceConfig]) -> list[str]:
    """Each source's name: its `name`, else "synthetic" or its file's stem (characters other than letters, digits,
    _ . - become _); a derived name that several sources share gets the source's index appended (json_0, json_2)."""
    derived = []
    for source in sources:
        stem = "synthetic" if source.data_path is None else Path(source.data_path.rstrip("/")).stem
        derived.append(re.sub(r"[^A-Za-z0-9_.-]", "_", stem) or "source")
    names = []
    for index, (source, name) in enumerate(zip(sources, derived)):
        if source.name is not None:
            names.append(source.name)
        else:
            names.append(name if derived.count(name) == 1 else f"{name}_{index}")
    return names


def _validate_mixture(d: DataConfig) -> None:
    """data.mixture: a non-empty list of valid sources that replaces data.dataset / data.data_path."""
    if not d.mixture:
        raise ConfigError(
            "Config key 'data.mixture' = [] is an empty list: a mixture needs at least one source. Give one "
            "{dataset, data_path, weight, max_samples} mapping per source, or remove data.mixture to train on "
            "data.dataset alone."
        )
    for key, default in (("dataset", "synthetic"), ("data_path", None)):
        if getattr(d, key) != default:
            raise ConfigError(
                f"Config keys 'data.mixture' and 'data.{key}' = {getattr(d, key)!r} are both set: a mixture replaces "
                f"data.dataset and data.data_path (each source names its own format and file). Move the data set into "
                f"a data.mixture entry (e.g. {{dataset: json, data_path: train.jsonl, weight: 1}}), or remove "
                f"data.mixture."
            )
    for index, source in enumerate(d.mixture):
        key = f"data.mixture[{index}]"
        _require(
            math.isfinite(source.weight) and source.weight > 0,
            f"{key}.weight",
            source.weight,
            "a finite number > 0 (the weights are normalised over the list: 3 and 1 train 75% / 25%)",
        )
        if source.max_samples is not None:
            _require(source.max_samples >= 1, f"{key}.max_samples", source.max_samples, "an integer >= 1 or null")
        if source.dataset == "synthetic" and source.data_path is not None:
            raise ConfigError(
                f"Config key '{key}.data_path' = {source.data_path!r} is set, but {key}.dataset is 'synthetic', "
                f"which reads no file. Set {key}.dataset to json or hf, or remove {key}.data_path."
            )
        _require(
            source.dataset == "synthetic" or source.data_path is not None,
            f"{key}.data_path",
            source.data_path,
            f"set when {key}.dataset is '{source.dataset}' (the .json/.jsonl file, or the Hugging Face data set)",
        )
        if source.name is not None:
            _require(
                MIXTURE_NAME.fullmatch(source.name) is not None,
                f"{key}.name",
                source.name,
                "letters, digits, _ . - starting with a letter or digit (it names the metrics data/<name>/...)",
            )
    names = mixture_names(d.mixture)
    for index, name in enumerate(names):
        if names.index(name) != index:
            raise ConfigError(
                f"Config keys 'data.mixture[{names.index(name)}]' and 'data.mixture[{index}]' have the same name "
                f"{name!r}: each source needs its own (metrics, checkpoint positions). Set data.mixture[{index}].name "
                f"to another name."
            )
    kinds = {source.dataset for source in d.mixture}
    if d.image_root is not None and kinds == {"synthetic"}:
        raise ConfigError(
            f"Config key 'data.image_root' = {d.image_root!r} is set, but every data.mixture source is synthetic, "
            f"which reads no file. Remove data.image_root."
        )
    if d.hf_split != "train" and "hf" not in kinds:
        raise ConfigError(
            f"Config key 'data.hf_split' = {d.hf_split!r} is set, but no data.mixture source has dataset hf, the only "
            f"format with splits. Remove data.hf_split."
        )


def _mixture_file_formats(d: DataConfig) -> set[str]:
    return {source.dataset for source in d.mixture or () if source.dataset != "synthetic"}


def validation_format(d: DataConfig) -> str:
    """The format data.validation_path is read in: data.dataset's, or the one file format of data.mixture's
    sources (checked by validate)."""
    return d.dataset if d.mixture is None else next(iter(_mixture_file_formats(d)))


def _validate_eval(config: Config) -> None:
    """The validation set (data.validation_path or data.validation_split) and the eval cadence that needs it."""
    d, t = config.data, config.training
    _require(
        0 <= d.validation_split < 1,
        "data.validation_split",
        d.validation_split,
        "a fraction in [0, 1) of the training data to hold out for validation (0: none), e.g. 0.05",
    )
    if d.validation_path is not None:
        _require(bool(d.validation_path.strip()), "data.validation_path", d.validation_path, "a path or null")
        if d.validation_split:
            raise ConfigError(
                f"Config keys 'data.validation_path' = {d.validation_path!r} and 'data.validation_split' = "
                f"{d.validation_split} are both set, but the validation set comes from one of them. Remove "
                f"data.validation_split to validate on the file, or data.validation_path to hold out that fraction "
                f"of the training data."
            )
        if d.mixture is not None and len(_mixture_file_formats(d)) != 1:
            formats = " and ".join(sorted(_mixture_file_formats(d))) or "no file format (every source is synthetic)"
            raise ConfigError(
                f"Config key 'data.validation_path' = {d.validation_path!r} is read in the format of data.mixture's "
                f"file sources, but the mixture has {formats}. Give the mixture's sources one file format (json or "
                f"hf) for the validation file to share, or remove data.validation_path."
            )
        if d.mixture is None and d.dataset == "synthetic":
            raise ConfigError(
                f"Config key 'data.validation_path' = {d.validation_path!r} is set, but data.dataset is 'synthetic', "
                f"which reads no file. Hold out part of the synthetic data with data.validation_split (e.g. 0.05), "
                f"or set data.dataset=json or hf with a validation file in that format."
            )
    if d.mixture is not None and d.validation_split:
        raise ConfigError(
            f"Config key 'data.validation_split' = {d.validation_split} is set together with data.mixture: a mixture's "
            f"samples are drawn from each source by its weight, so there is no single data set to hold a fraction "
            f"out of. Give a validation file with data.validation_path (in the mixture's file format), or remove "
            f"data.validation_split."
        )
    for key in ("eval_interval", "eval_iters", "save_best"):
        value = getattr(t, key)
        _require(value >= 0, f"training.{key}", value, "an integer >= 0")
        if value and d.validation_path is None and not d.validation_split:
            raise ConfigError(
                f"Config key 'training.{key}' = {value} is set, but there is no validation data to evaluate on. "
                f"Set data.validation_path (a file in data.dataset's format) or data.validation_split (a fraction "
                f"of the training data to hold out), or remove training.{key}."
            )


def _validate_router(config: Config) -> None:
    router = config.features.router
    _require(
        math.isfinite(router.bias_update_rate) and 0 <= router.bias_update_rate < 1,
        "features.router.bias_update_rate",
        router.bias_update_rate,
        "in [0, 1) (0: off; the bias is on the scale of the sigmoid scores in (0, 1): DeepSeek-V3 used 1e-3)",
    )
    _require(
        math.isfinite(router.aux_loss_coef) and router.aux_loss_coef >= 0,
        "features.router.aux_loss_coef",
        router.aux_loss_coef,
        "a finite number >= 0 (0: off; DeepSeek-V3 used 1e-4 for its sequence-wise loss)",
    )
    _require(
        router.aux_loss_coef > 0 or router.aux_loss_type == "sequence",
        "features.router.aux_loss_type",
        router.aux_loss_type,
        "left at 'sequence' while features.router.aux_loss_coef is 0 (no auxiliary loss is computed); set "
        "features.router.aux_loss_coef > 0 to use it",
    )
    if router.bias_update_rate > 0 and config.model.lora.rank > 0:
        raise ConfigError(
            f"Config key 'features.router.bias_update_rate' = {router.bias_update_rate} cannot be used with LoRA "
            f"(model.lora.rank = {config.model.lora.rank}): the routers' e_score_correction_bias is a buffer of the "
            f"frozen base, which a LoRA run's checkpoints and its PEFT adapter do not carry, so the updated bias "
            f"would be lost. Set features.router.bias_update_rate=0, or fine-tune without LoRA."
        )
    recompute = config.features.recompute
    if router.aux_loss_coef > 0 and recompute.enabled and recompute.use_reentrant:
        raise ConfigError(
            f"Config key 'features.router.aux_loss_coef' = {router.aux_loss_coef} cannot be used with "
            f"features.recompute.use_reentrant=true: the reentrant checkpoint runs the layers' forward without "
            f"autograd, so the auxiliary loss would get no gradient. Set features.recompute.use_reentrant=false "
            f"(the default) or features.router.aux_loss_coef=0."
        )


def validate(config: Config) -> None:
    """Checks that need nothing but the config itself."""
    t, d, p = config.training, config.data, config.parallel
    for key in ("train_iters", "micro_batch_size", "gradient_accumulation_steps", "log_interval"):
        _require(getattr(t, key) >= 1, f"training.{key}", getattr(t, key), "an integer >= 1")
    _require(t.lr >= 0, "training.lr", t.lr, ">= 0")
    _require(0 <= t.min_lr <= t.lr, "training.min_lr", t.min_lr, f"between 0 and training.lr ({t.lr})")
    _require(0 <= t.lr_warmup_ratio < 1, "training.lr_warmup_ratio", t.lr_warmup_ratio, "in [0, 1)")
    _require(t.weight_decay >= 0, "training.weight_decay", t.weight_decay, ">= 0")
    _require(0 <= t.adam_beta1 < 1, "training.adam_beta1", t.adam_beta1, "in [0, 1)")
    _require(0 <= t.adam_beta2 < 1, "training.adam_beta2", t.adam_beta2, "in [0, 1)")
    _require(t.adam_eps > 0, "training.adam_eps", t.adam_eps, "> 0")
    _require(t.clip_grad >= 0, "training.clip_grad", t.clip_grad, ">= 0 (0 disables clipping)")
    _require(t.max_skipped_steps >= 0, "training.max_skipped_steps", t.max_skipped_steps, ">= 0")
    scale = t.loss_scale
    _require(scale.static_scale >= 0, "training.loss_scale.static_scale", scale.static_scale, ">= 0 (0 = dynamic)")
    _require(scale.window >= 1, "training.loss_scale.window", scale.window, "an integer >= 1")
    _require(scale.hysteresis >= 1, "training.loss_scale.hysteresis", scale.hysteresis, "an integer >= 1")
    _require(scale.min_scale > 0, "training.loss_scale.min_scale", scale.min_scale, "> 0")
    _require(
        0 <= scale.initial_scale_power <= 64,
        "training.loss_scale.initial_scale_power",
        scale.initial_scale_power,
        "an integer in [0, 64]",
    )
    _require(
        0 <= t.stats_start_step <= t.train_iters,
        "training.stats_start_step",
        t.stats_start_step,
        f"between 0 (automatic) and training.train_iters ({t.train_iters})",
    )
    _require(bool(t.output_dir), "training.output_dir", t.output_dir, "a non-empty path")
    _require(t.save_interval >= 0, "training.save_interval", t.save_interval, ">= 0 (0 = save only at the end)")
    _require(t.save_keep_last >= 0, "training.save_keep_last", t.save_keep_last, ">= 0 (0 = keep all)")
    _require(t.dump_batches >= 0, "training.dump_batches", t.dump_batches, ">= 0")
    if t.profile_steps is not None:
        _require(
            len(t.profile_steps) == 2 and 1 <= t.profile_steps[0] <= t.profile_steps[1] <= t.train_iters,
            "training.profile_steps",
            t.profile_steps,
            f"[first, last] with 1 <= first <= last <= training.train_iters ({t.train_iters}), or null",
        )
    if t.load is None:
        for key in ("load_format", "no_load_optim", "no_load_rng"):
            default = getattr(TrainingConfig, key)
            _require(
                getattr(t, key) == default,
                f"training.{key}",
                getattr(t, key),
                f"{default!r} unless training.load is set",
            )
    if t.save is None:
        for key in ("save_interval", "save_keep_last", "async_save", "save_best"):
            default = getattr(TrainingConfig, key)
            _require(
                getattr(t, key) == default,
                f"training.{key}",
                getattr(t, key),
                f"{default!r} unless training.save is set",
            )
    _require(d.cutoff_len >= 8, "data.cutoff_len", d.cutoff_len, "an integer >= 8")
    _require(d.num_workers >= 0, "data.num_workers", d.num_workers, ">= 0")
    _require(d.synthetic_samples >= 1, "data.synthetic_samples", d.synthetic_samples, ">= 1")
    _require(d.synthetic_text_tokens >= 1, "data.synthetic_text_tokens", d.synthetic_text_tokens, ">= 1")
    _require(
        d.synthetic_images_per_sample >= 0,
        "data.synthetic_images_per_sample",
        d.synthetic_images_per_sample,
        ">= 0",
    )
    check_ops_setting(config.model.ops)
    _require(d.max_image_pixels >= 1, "data.max_image_pixels", d.max_image_pixels, "a positive pixel count")
    _require(d.synthetic_image_size >= 28, "data.synthetic_image_size", d.synthetic_image_size, ">= 28 pixels")
    _require(d.synthetic_video_every >= 0, "data.synthetic_video_every", d.synthetic_video_every, ">= 0 (0: no videos)")
    _require(d.synthetic_video_frames >= 1, "data.synthetic_video_frames", d.synthetic_video_frames, ">= 1")
    _require(d.video_fps > 0, "data.video_fps", d.video_fps, "frames per second > 0")
    _require(
        d.video_max_frames >= 2 and d.video_max_frames % 2 == 0,
        "data.video_max_frames",
        d.video_max_frames,
        "an even integer >= 2 (the vision tower takes frames in pairs)",
    )
    _require(d.video_max_pixels >= 28 * 28, "data.video_max_pixels", d.video_max_pixels, ">= 784 (28 x 28) pixels")
    _require(d.video_max_seconds > 0, "data.video_max_seconds", d.video_max_seconds, "seconds > 0")
    _require(d.video_decode_timeout_s > 0, "data.video_decode_timeout_s", d.video_decode_timeout_s, "seconds > 0")
    if d.mixture is not None:
        _validate_mixture(d)
    elif d.dataset == "json":
        _require(d.data_path is not None, "data.data_path", d.data_path, "set when data.dataset is 'json'")
    elif d.dataset == "hf":
        _require(
            d.data_path is not None,
            "data.data_path",
            d.data_path,
            "set when data.dataset is 'hf' (a save_to_disk directory, a .parquet file or directory, an .arrow file)",
        )
    else:
        for key in ("data_path", "image_root"):
            if getattr(d, key) is not None:
                raise ConfigError(
                    f"Config key 'data.{key}' = {getattr(d, key)!r} is set, but data.dataset is 'synthetic', which "
                    f"reads no file: the run would train on built-in synthetic data. Set data.dataset=json to train "
                    f"on the file (.json or .jsonl), or data.dataset=hf (a Hugging Face data set), or remove "
                    f"data.{key}."
                )
    _require(bool(d.hf_split.strip()), "data.hf_split", d.hf_split, "a split name, e.g. 'train'")
    if d.mixture is None and d.dataset != "hf" and d.hf_split != "train":
        raise ConfigError(
            f"Config key 'data.hf_split' = {d.hf_split!r} is set, but data.dataset is '{d.dataset}', which has no "
            f"splits: only data.dataset=hf reads one. Set data.dataset=hf, or remove data.hf_split."
        )
    for key in ("data_parallel_replicate_size", "ulysses_parallel_size", "ring_attention_size", "expert_parallel_size"):
        _require(getattr(p, key) >= 1, f"parallel.{key}", getattr(p, key), "an integer >= 1")
    _require(bool(p.ep_plan.apply_modules), "parallel.ep_plan.apply_modules", [], "a non-empty list of patterns")
    _require(config.model.router_skew >= 0, "model.router_skew", config.model.router_skew, ">= 0")
    _validate_lora(config)
    _validate_eval(config)
    balance = config.features.ep_balance
    if balance.enabled:
        _require(
            balance.max_dup_experts_num >= 1,
            "features.ep_balance.max_dup_experts_num",
            balance.max_dup_experts_num,
            "an integer >= 1",
        )
        _require(
            balance.target_max_over_mean >= 1,
            "features.ep_balance.target_max_over_mean",
            balance.target_max_over_mean,
            ">= 1.0",
        )
        _require(
            balance.trigger_max_over_mean >= balance.target_max_over_mean,
            "features.ep_balance.trigger_max_over_mean",
            balance.trigger_max_over_mean,
            f">= features.ep_balance.target_max_over_mean ({balance.target_max_over_mean})",
        )
        if p.expert_parallel_size == 1 or p.ep_plan.dispatcher != "alltoall":
            raise ConfigError(
                f"Config key 'features.ep_balance.enabled' = true needs expert parallelism with the alltoall "
                f"dispatcher (parallel.expert_parallel_size = {p.expert_parallel_size}, parallel.ep_plan.dispatcher "
                f"= {p.ep_plan.dispatcher!r}): balance moves tokens between the ranks of an EP group. Set "
                f"parallel.expert_parallel_size > 1 with dispatcher=alltoall, or features.ep_balance.enabled=false."
            )
    _validate_router(config)
    _require(bool(p.fsdp_plan.apply_modules), "parallel.fsdp_plan.apply_modules", [], "a non-empty list of patterns")
    _require(
        p.fsdp_plan.unit_mib is None or p.fsdp_plan.unit_mib >= 0,
        "parallel.fsdp_plan.unit_mib",
        p.fsdp_plan.unit_mib,
        ">= 0 (MiB; 0: a unit per module) or null (the device's default)",
    )
    _require(p.fsdp_plan.prefetch >= 0, "parallel.fsdp_plan.prefetch", p.fsdp_plan.prefetch, "an integer >= 0")
    chunk = config.features.chunk_loss
    _require(chunk.chunk_size >= 1, "features.chunk_loss.chunk_size", chunk.chunk_size, "an integer >= 1")
    if chunk.total_chunk_size is not None:
        _require(
            chunk.total_chunk_size >= 1, "features.chunk_loss.total_chunk_size", chunk.total_chunk_size, ">= 1 or null"
        )
    _require(chunk.logits_budget_mib > 0, "features.chunk_loss.logits_budget_mib", chunk.logits_budget_mib, "> 0")
    recompute = config.features.recompute
    if recompute.enabled:
        _require(bool(recompute.apply_modules), "features.recompute.apply_modules", [], "a non-empty list of patterns")
        _require(
            not (recompute.use_reentrant and recompute.granularity == "selective"),
            "features.recompute.use_reentrant",
            True,
            "false with granularity=selective (selective recompute needs the non-reentrant checkpoint)",
        )
    offload = config.features.activation_offload
    _require(
        offload.min_tensor_bytes >= 0,
        "features.activation_offload.min_tensor_bytes",
        offload.min_tensor_bytes,
        "an integer >= 0 (saved tensors smaller than this stay on the device)",
    )
    if offload.enabled:
        _require(
            bool(offload.apply_modules),
            "features.activation_offload.apply_modules",
            [],
            "a non-empty list of patterns",
        )


def validate_layout(p: ParallelConfig, world_size: int) -> None:
    """Checks that need the world size: every parallel size must divide it."""
    cp = p.ulysses_parallel_size * p.ring_attention_size
    if world_size % (p.data_parallel_replicate_size * cp) != 0:
        # Name the keys that were set (a size of 1 is the default and divides everything).
        sizes = {
            "parallel.data_parallel_replicate_size": p.data_parallel_replicate_size,
            "parallel.ulysses_parallel_size": p.ulysses_parallel_size,
            "parallel.ring_attention_size": p.ring_attention_size,
        }
        if world_size % cp == 0:  # context parallelism fits: replication is what does not
            sizes = {"parallel.data_parallel_replicate_size": p.data_parallel_replicate_size}
        named = {key: size for key, size in sizes.items() if size > 1}
        product = p.data_parallel_replicate_size * cp
        keys = " x ".join(f"'{key}' = {size}" for key, size in named.items())
        raise ConfigError(
            f"Config key{'s' if len(named) > 1 else ''} {keys} need{'' if len(named) > 1 else 's'} a multiple of "
            f"{product} processes, but the job has world size {world_size}. Start {product} or a multiple of it "
            f"(e.g. torchrun --nproc_per_node {product}), or choose sizes whose product divides {world_size}."
        )
    dp_shard = world_size // (p.data_parallel_replicate_size * cp)
    if (dp_shard * cp) % p.expert_parallel_size != 0:
        raise ConfigError(
            f"Config key 'parallel.expert_parallel_size' = {p.expert_parallel_size} does not divide "
            f"dp_shard x cp = {dp_shard * cp} (world size {world_size}). Choose a divisor of {dp_shard * cp}."
        )


def to_dict(config: Config) -> dict:
    return dataclasses.asdict(config)


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)
