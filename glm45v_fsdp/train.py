"""Entry point: `python -m glm45v_fsdp.train [--config C] [key.path=value ...]` (console script `glm45v-train`).

Runs as a single process or under any launcher (torchrun, deepspeed, srun, mpirun). With no arguments it trains the
embedded tiny GLM-4.5V on built-in synthetic image-text data.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, NoReturn

from glm45v_fsdp.errors import TrainingStopped, UserError

if TYPE_CHECKING:
    from torch import nn

    from glm45v_fsdp.config import Config

EXIT_USER_ERROR = 2
EXIT_STOPPED = 3


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
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides applied after the YAML file")
    return parser.parse_args(argv)


def run(argv: list[str]) -> dict:
    """Parse, validate, build, resume (DCP), train, export (training.save_hf); returns the end-of-run summary."""
    from glm45v_fsdp.builders import build_data, build_model, build_runtime
    from glm45v_fsdp.checkpoint.dcp import check_save_targets, resolve_load
    from glm45v_fsdp.checkpoint.state import data_start_step, read_trainer_state
    from glm45v_fsdp.config import load_config
    from glm45v_fsdp.log import setup_logging
    from glm45v_fsdp.metrics import check_outputs
    from glm45v_fsdp.runtime import shutdown
    from glm45v_fsdp.trainer import Trainer

    args = parse_args(argv)
    config = load_config(args.config, args.overrides)
    check_outputs(config.training)
    check_save_targets(config.training)
    source = resolve_load(config.training)  # path errors before any collective; build_model loads HF weights
    resume = source.path if source is not None and source.format == "dcp" else None
    runtime = build_runtime(config, local_rank_arg=args.local_rank)
    finished = False
    try:
        setup_logging(runtime.env.rank)
        model, hf_config = build_model(config, runtime)
        training = config.training
        global_batch = training.micro_batch_size * training.gradient_accumulation_steps * runtime.dp_size
        start_step = data_start_step(read_trainer_state(resume), global_batch) if resume else 0
        loader, tokenizer = build_data(config, runtime, hf_config, start_step=start_step)
        trainer = Trainer(config, runtime, model, loader)
        if resume:
            trainer.resume(resume)
        summary = trainer.run()
        if training.save_hf:
            export_final_weights(config, model, hf_config, tokenizer)
        finished = True
        return summary
    finally:
        shutdown(finished)


def export_final_weights(config: Config, model: nn.Module, hf_config: object, tokenizer: object) -> None:
    """training.save_hf: the trained weights as an HF model directory (collective: every rank calls it)."""
    from glm45v_fsdp.checkpoint.hf_export import export_hf
    from glm45v_fsdp.data import load_image_processor
    from glm45v_fsdp.log import get_logger

    image_processor = load_image_processor(config.model.name_or_path, hf_config.vision_config)
    export_hf(model, config.training.save_hf, hf_config, tokenizer=tokenizer, image_processor=image_processor)
    get_logger().info("exported the final weights as HF safetensors to %s", config.training.save_hf)


def end_process(code: int) -> NoReturn:
    """Flush and end the process without the interpreter's teardown (see runtime.dist.shutdown): every output is
    written and every rank has passed the final barrier by now."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Run, then end the process (a finished run exits through `end_process`); user errors return 2, a stop 3."""
    try:
        run(sys.argv[1:] if argv is None else argv)
    except UserError as error:
        print(f"glm45v-train: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except TrainingStopped as error:
        print(f"glm45v-train: {error}", file=sys.stderr)
        return EXIT_STOPPED
    end_process(0)


if __name__ == "__main__":
    sys.exit(main())
