"""Entry point: `python -m glm45v_fsdp.train [--config C] [--deepspeed ds_config.json] [key.path=value ...]`
(console script `glm45v-train`).

Runs as a single process or under any launcher (torchrun, deepspeed, srun, mpirun). With no arguments it trains the
embedded tiny GLM-4.5V on built-in synthetic image-text data. With `--deepspeed` (or `--deepspeed_config`) a
DeepSpeed config supplies batch sizes, optimizer, scheduler, precision, sharding, clipping and recompute, and the
YAML config the model and the data (ds_compat.trainer_door).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from glm45v_fsdp.errors import (
    EXIT_USER_ERROR,
    ConfigError,
    Preempted,
    TrainingStopped,
    UserError,
    launcher_rank,
    report_user_error,
)

if TYPE_CHECKING:
    from torch import nn

    from glm45v_fsdp.builders import TrainingData
    from glm45v_fsdp.config import Config

EXIT_STOPPED = 3
CONFIG_ERROR_GRACE_S = 2.0  # a rank other than 0 waits this long after a config error, which rank 0 alone prints


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="glm45v-train",
        description="Train GLM-4.5V on FSDP2. Overrides are key.path=value, e.g. training.train_iters=40.",
    )
    parser.add_argument("--config", default=None, help="YAML config (default: configs/glm45v_tiny.yaml)")
    parser.add_argument(
        "--local_rank",
        "--local-rank",
        dest="local_rank",
        type=int,
        default=None,
        help="set by the deepspeed launcher; must agree with LOCAL_RANK",
    )
    deepspeed = parser.add_argument_group("DeepSpeed config (as the deepspeed launcher and HF Trainer pass it)")
    deepspeed.add_argument(
        "--deepspeed",
        nargs="?",
        const=True,
        default=None,
        metavar="DS_CONFIG",
        help="ds_config.json to take batch, optimizer, scheduler, precision, ZeRO stage and clipping from "
        "(a bare --deepspeed needs --deepspeed_config)",
    )
    deepspeed.add_argument("--deepspeed_config", default=None, help="ds_config.json (DeepSpeed's own flag)")
    deepspeed.add_argument("--deepscale_config", default=None, help=argparse.SUPPRESS)  # DeepSpeed's old alias
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides applied after the YAML file")
    args = parser.parse_intermixed_args(argv)  # launchers put their flags before or after the overrides
    if isinstance(args.deepspeed, str) and "=" in args.deepspeed and not os.path.exists(args.deepspeed):
        # A bare `--deepspeed` (DeepSpeed's own boolean flag) followed by an override took it as its value.
        args.overrides.insert(0, args.deepspeed)
        args.deepspeed = True
    return args


def deepspeed_config_path(args: argparse.Namespace) -> str | None:
    """The ds_config named by --deepspeed PATH / --deepspeed_config PATH (they must agree), or None."""
    from glm45v_fsdp.errors import UserError

    named = {
        flag: value
        for flag, value in (
            ("--deepspeed", args.deepspeed if isinstance(args.deepspeed, str) else None),
            ("--deepspeed_config", args.deepspeed_config),
            ("--deepscale_config", args.deepscale_config),
        )
        if value is not None
    }
    if len(set(named.values())) > 1:
        raise UserError(
            f"Two DeepSpeed configs were given: {', '.join(f'{k} {v}' for k, v in named.items())}. Pass one."
        )
    if args.deepspeed is True and not named:
        raise UserError(
            "--deepspeed was given without a config file. Pass --deepspeed ds_config.json or "
            "--deepspeed_config ds_config.json."
        )
    return next(iter(named.values()), None)


def run(argv: list[str]) -> dict:
    """Parse, validate, build, resume (DCP), train, export (training.save_hf); returns the end-of-run summary."""
    args = parse_args(argv)  # before torch is imported: --help and usage errors answer at once
    from glm45v_fsdp.builders import (
        build_eval_batches,
        build_loader,
        build_model,
        build_runtime,
        build_training_data,
    )
    from glm45v_fsdp.checkpoint.base_reference import base_reference, holds_trainable_only, read_base
    from glm45v_fsdp.checkpoint.dcp import (
        auto_resume,
        check_save_targets,
        load_model_weights,
        resolve_load,
        verify_resume,
    )
    from glm45v_fsdp.checkpoint.deepspeed import read_deepspeed
    from glm45v_fsdp.checkpoint.state import data_start_step, read_trainer_state
    from glm45v_fsdp.config import load_config
    from glm45v_fsdp.log import get_logger, setup_logging
    from glm45v_fsdp.metrics import check_outputs
    from glm45v_fsdp.model import load_hf_config
    from glm45v_fsdp.runtime import shutdown
    from glm45v_fsdp.trainer import Trainer

    config = load_config(args.config, args.overrides)
    ds_run = None
    ds_path = deepspeed_config_path(args)
    if ds_path is not None:
        from ds_compat.trainer_door import configure
        from glm45v_fsdp.runtime import detect_dist_env

        world_size = detect_dist_env(local_rank_arg=args.local_rank).world_size
        ds_run = configure(ds_path, config, args.overrides, world_size)
        config = ds_run.config
    check_outputs(config.training)
    check_save_targets(config.training)
    config.training, weights_line = load_model_weights(config)
    lora_base = lora_base_reference(config)  # before a resume replaces training.load
    config.training, resume_line = auto_resume(config.training)
    source = resolve_load(config.training)  # path errors before any collective; build_model loads HF weights
    resume = source if source is not None and source.format in ("dcp", "deepspeed") else None
    hf_config = load_hf_config(config.model)
    runtime = build_runtime(config, local_rank_arg=args.local_rank)
    finished = False
    try:
        setup_logging(runtime.env.rank)
        get_logger().info(runtime.cpu_threads)
        get_logger().info(runtime.network)
        get_logger().info(runtime.topology)
        for line in (weights_line, resume_line):
            if line is not None:
                get_logger().info(line)
        verify_resume(source, config.training)  # once, split over the ranks, before anything of it is read
        data = build_training_data(config, hf_config)  # a bad data file stops the run before the model is built
        if ds_run is not None:
            record_deepspeed_config(ds_run, runtime.is_main)
        model, hf_config = build_model(config, runtime, hf_config)
        training = config.training
        global_batch = training.micro_batch_size * training.gradient_accumulation_steps * runtime.dp_size
        start_step, deepspeed_state, saved_state = 0, None, None
        if resume is not None and resume.format == "dcp":
            saved_state = read_trainer_state(resume.path)
            start_step = data_start_step(saved_state, global_batch)
        elif resume is not None:
            deepspeed_state = read_deepspeed(resume.path, with_optimizer=not training.no_load_optim)
            saved_state = {"consumed_samples": int(deepspeed_state.model_states.get("global_samples") or 0)}
            start_step = data_start_step(saved_state, global_batch)
        loader = build_loader(config, runtime, data, start_step=start_step, saved_state=saved_state)
        recipe = ds_run.recipe if ds_run is not None else None
        if resume is not None and resume.format == "dcp" and holds_trainable_only(resume.path):
            lora_base = base_reference(read_base(resume.path))  # the base the resumed run trained on
        eval_batches = build_eval_batches(config, runtime, data)
        trainer = Trainer(config, runtime, model, loader, recipe=recipe, lora_base=lora_base, eval_batches=eval_batches)
        if resume is not None and resume.format == "dcp":
            trainer.resume(resume.path)
        elif deepspeed_state is not None:
            trainer.resume_deepspeed(deepspeed_state)
        summary = trainer.run()
        if config.model.lora.rank:
            export_adapter(config, model)
        if training.save_hf:
            export_final_weights(config, model, hf_config, data)
        finished = True
        return summary
    except (UserError, TrainingStopped):
        stand_down()
        raise
    finally:
        shutdown(finished)


def lora_base_reference(config: object) -> dict | None:
    """A LoRA run's reference to the HF base it loads (its checkpoints then hold the trainable state only); None when
    LoRA is off or the base is not an HF directory (a base initialised from the seed, or from a DCP checkpoint: the
    checkpoints then hold the whole model)."""
    from glm45v_fsdp.checkpoint.base_reference import base_reference
    from glm45v_fsdp.checkpoint.dcp import resolve_load

    if not config.model.lora.rank:
        return None
    source = resolve_load(config.training)
    return base_reference(source.path) if source is not None and source.format == "hf" else None


def record_deepspeed_config(ds_run: object, is_main: bool) -> None:
    """Log how the ds_config maps onto the engine and keep it (auto values filled) next to config.yaml."""
    from glm45v_fsdp.log import get_logger

    if not is_main:
        return
    get_logger().info("DeepSpeed config translated onto the FSDP2 engine:\n%s", ds_run.explain())
    for warning in ds_run.translation.misspelled:
        get_logger().warning("DeepSpeed config: %s", warning)
    output_dir = Path(ds_run.config.training.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "ds_config.json").write_text(json.dumps(ds_run.translation.ds_config, indent=2) + "\n")


def export_final_weights(config: Config, model: nn.Module, hf_config: object, data: TrainingData) -> None:
    """training.save_hf: the trained weights as an HF model directory (collective: every rank calls it)."""
    from glm45v_fsdp.checkpoint.hf_export import export_hf
    from glm45v_fsdp.log import get_logger

    export_hf(model, config.training.save_hf, hf_config, tokenizer=data.tokenizer, image_processor=data.image_processor)
    get_logger().info("exported the final weights as HF safetensors to %s", config.training.save_hf)


def export_adapter(config: Config, model: nn.Module) -> None:
    """LoRA: the trained adapters in PEFT's format in <output_dir>/adapter (collective: every rank calls it), which
    PeftModel.from_pretrained(<the base in transformers>, dir) loads."""
    from glm45v_fsdp.log import get_logger
    from glm45v_fsdp.lora.peft_format import save_adapter

    directory = Path(config.training.output_dir) / "adapter"
    save_adapter(model, directory, config.model.name_or_path)
    get_logger().info("lora: adapters saved in PEFT's format to %s", directory)


def end_process(code: int) -> NoReturn:
    """Flush and end the process without the interpreter's teardown, whose gloo part occasionally aborts a rank
    that has already written everything (see runtime.dist.shutdown)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stand_down() -> None:
    """This rank ends on an error it raised itself (every rank raises a user error or a stop alike, from the same
    gathered figures): its watchdog must not end it with EXIT_PEER_FAILED while it tears down, when a peer that got
    there first has reported or, as rank 0, exited with the store."""
    from glm45v_fsdp.runtime.watchdog import current_watchdog

    watchdog = current_watchdog()
    if watchdog is not None:
        watchdog.disarm()


def report_failure(error: BaseException) -> None:
    """Tell the other ranks (runtime/watchdog.py) that this one is ending on an error, so none waits for it."""
    from glm45v_fsdp.runtime.watchdog import current_watchdog

    watchdog = current_watchdog()
    if watchdog is not None:
        watchdog.report_failure(f"{type(error).__name__}: {str(error)[:300]}")


def main(argv: list[str] | None = None) -> NoReturn:
    """Run, then end the process through `end_process` (no interpreter teardown, see runtime.dist.shutdown): 0 when
    finished, 2 on a user error, 3 on a stop, 143 on a preemption (after its checkpoint). A crash keeps its
    traceback and the interpreter's exit."""
    try:
        try:
            run(sys.argv[1:] if argv is None else argv)
        except BaseException:
            if "glm45v_fsdp.runtime.stuck" in sys.modules:  # imported by a run that got as far as training
                sys.modules["glm45v_fsdp.runtime.stuck"].hold_for_stuck_exit()  # a stuck verdict ends it with 5
            raise
    except UserError as error:
        report_failure(error)
        report_user_error("glm45v-train", error)
        if isinstance(error, ConfigError) and launcher_rank() != 0:
            time.sleep(CONFIG_ERROR_GRACE_S)  # only rank 0 prints it: a launcher ends rank 0 once this rank exits
        end_process(EXIT_USER_ERROR)
    except TrainingStopped as error:
        report_failure(error)
        print(f"glm45v-train: {error}", file=sys.stderr)
        end_process(EXIT_STOPPED)
    except Preempted as error:  # every rank stops at the same step: not a failure of one
        from glm45v_fsdp.runtime.preemption import EXIT_PREEMPTED
        from glm45v_fsdp.runtime.watchdog import current_watchdog

        watchdog = current_watchdog()
        if watchdog is not None:
            watchdog.finish()
        print(f"glm45v-train: {error}", file=sys.stderr)
        end_process(EXIT_PREEMPTED)
    except Exception as error:  # a crash keeps its traceback; a lost peer is named by node first
        from glm45v_fsdp.log import get_logger
        from glm45v_fsdp.runtime.topology import lost_peer

        note = lost_peer(str(error))
        if note is not None:
            get_logger().error(note)
            report_failure(RuntimeError(note))
        raise
    end_process(0)


if __name__ == "__main__":
    main()
