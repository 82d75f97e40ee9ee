"""Entry point: `python -m glm45v_fsdp.train [--config C] [key.path=value ...]` (console script `glm45v-train`).

Runs as a single process or under any launcher (torchrun, deepspeed, srun, mpirun). With no arguments it trains the
embedded tiny GLM-4.5V on built-in synthetic image-text data.
"""

from __future__ import annotations

import argparse
import sys

from glm45v_fsdp.errors import TrainingStopped, UserError

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
    """Parse, validate, build and train; returns the end-of-run summary."""
    from glm45v_fsdp.builders import build_data, build_model, build_runtime
    from glm45v_fsdp.config import load_config
    from glm45v_fsdp.log import setup_logging
    from glm45v_fsdp.metrics import check_outputs
    from glm45v_fsdp.runtime import shutdown
    from glm45v_fsdp.trainer import Trainer

    args = parse_args(argv)
    config = load_config(args.config, args.overrides)
    check_outputs(config.training)
    runtime = build_runtime(config, local_rank_arg=args.local_rank)
    try:
        setup_logging(runtime.env.rank)
        model, hf_config = build_model(config, runtime)
        loader, _ = build_data(config, runtime, hf_config)
        return Trainer(config, runtime, model, loader).run()
    finally:
        shutdown()


def main(argv: list[str] | None = None) -> int:
    try:
        run(sys.argv[1:] if argv is None else argv)
    except UserError as error:
        print(f"glm45v-train: error: {error}", file=sys.stderr)
        return EXIT_USER_ERROR
    except TrainingStopped as error:
        print(f"glm45v-train: {error}", file=sys.stderr)
        return EXIT_STOPPED
    return 0


if __name__ == "__main__":
    sys.exit(main())
