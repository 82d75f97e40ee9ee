"""Convert and inspect GLM-4.5V checkpoints: `python -m glm45v_fsdp.tools.convert COMMAND ...`.

  inspect PATH [--config C]          keys (per-layer patterns collapsed), shapes, dtypes, expert layout and key
                                     prefixes of an HF directory or a DCP checkpoint; with --config, whether it fits
                                     that config's model (exit 1 with the differences when not).
  dcp-to-hf CKPT OUT [--config C]    a DCP checkpoint (or the newest complete one of a save directory) -> HF
                                     safetensors, experts per expert, loadable by transformers.
  hf-to-dcp HF OUT [--config C]      HF safetensors (either expert layout) -> a DCP checkpoint {"model": state dict}.
  ds-to-hf DS_DIR OUT [--config C]   a DeepSpeed checkpoint (ZeRO 0-3, any world size; its fp32 master weights) -> HF
                                     safetensors; ds-to-dcp DS_DIR OUT: -> a weights-only DCP checkpoint. To keep
                                     the optimizer and the step, point training.load at the DeepSpeed directory.
  bin-to-hf HF OUT                   an HF directory whose weights are pytorch_model*.bin pickles -> safetensors,
                                     each read weights-only (the only way this backend reads a .bin).
  dcp-to-ds CKPT OUT --zero-stage N --world-size W   one of our checkpoints -> DeepSpeed's layout for ZeRO stage N
                                     on W ranks (checkpoint/deepspeed_write.py): DeepSpeed resumes it.
  lora-merge BASE ADAPTER OUT        an HF base + a PEFT LoRA adapter (ours or PEFT's, experts included) -> the
                                     merged model (W + alpha/r B A per weight, per expert) as HF safetensors.
  verify PATH                        every file of a checkpoint (or of every checkpoint of a save directory) against
                                     its manifest of checksums: exit 0 when all are intact, 1 when one is damaged or
                                     has no manifest.

Both conversions run in one process and build the model from --config, else from the config the input carries
(a training checkpoint's trainer state, or config.json), else the default tiny config. Errors exit 2.
"""

from __future__ import annotations

import argparse
import sys

from glm45v_fsdp.errors import UserError

PROG = "python -m glm45v_fsdp.tools.convert"


def _add_model_options(sub: argparse.ArgumentParser, dtype: bool) -> None:
    """--config (the model to build) and, for a command that writes HF files, --dtype."""
    sub.add_argument(
        "--config", help="training YAML whose model section describes the model (default: the checkpoint's own)"
    )
    if dtype:
        sub.add_argument("--dtype", choices=("bf16", "fp32"), help="tensor dtype to write (default: as stored, fp32)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description="Convert and inspect GLM-4.5V checkpoints (HF and DCP).")
    commands = parser.add_subparsers(dest="command", required=True)
    sub = commands.add_parser("inspect", help="keys, shapes, dtypes, expert layout, prefixes; --config: fit check")
    sub.add_argument("path", help="an HF model directory, a DCP checkpoint, a training.save or a DeepSpeed directory")
    sub.add_argument("--config", help="training YAML to check the checkpoint against (exit 1 if it does not fit)")
    sub = commands.add_parser("dcp-to-hf", help="DCP checkpoint -> HF safetensors (per-expert layout)")
    sub.add_argument("checkpoint", help="a DCP checkpoint or a training.save directory (its newest complete one)")
    sub.add_argument("out", help="new HF model directory")
    _add_model_options(sub, dtype=True)
    sub = commands.add_parser("hf-to-dcp", help="HF safetensors (either expert layout) -> DCP checkpoint")
    sub.add_argument("hf", help="an HF model directory")
    sub.add_argument("out", help="new DCP checkpoint directory")
    _add_model_options(sub, dtype=False)
    sub = commands.add_parser("bin-to-hf", help="HF directory with pytorch_model*.bin -> safetensors (weights-only)")
    sub.add_argument("hf", help="an HF model directory whose weights are pytorch_model*.bin files")
    sub.add_argument("out", help="new HF model directory (safetensors, the other files copied)")
    for name, what in (
        ("ds-to-hf", "HF safetensors (per-expert layout)"),
        ("ds-to-dcp", "a weights-only DCP checkpoint (training.load starts from it at step 0)"),
    ):
        sub = commands.add_parser(name, help=f"DeepSpeed checkpoint (ZeRO 0-3, any world size) -> {what}")
        sub.add_argument("deepspeed", help="a DeepSpeed save_dir (its `latest` tag) or one global_stepN directory")
        sub.add_argument("out", help="new output directory")
        sub.add_argument("--config", help="training YAML whose model section describes the model (default: tiny)")
        if name == "ds-to-hf":
            sub.add_argument("--dtype", choices=("bf16", "fp32"), help="tensor dtype to write (default: fp32)")
    sub = commands.add_parser("dcp-to-ds", help="our checkpoint -> DeepSpeed's layout (DeepSpeed resumes it)")
    sub.add_argument("checkpoint", help="an engine save_dir / tag, a training.save directory or one checkpoint")
    sub.add_argument("out", help="new DeepSpeed save_dir (latest + global_stepN)")
    sub.add_argument("--zero-stage", type=int, required=True, help="the ZeRO stage DeepSpeed resumes with")
    sub.add_argument("--world-size", type=int, required=True, help="the data-parallel ranks DeepSpeed resumes on")
    sub = commands.add_parser("lora-merge", help="HF base + PEFT LoRA adapter -> the merged model, HF safetensors")
    sub.add_argument("base", help="the base's HF model directory")
    sub.add_argument("adapter", help="a PEFT LoRA adapter directory (a checkpoint's adapter/, save_pretrained's)")
    sub.add_argument("out", help="new HF model directory")
    _add_model_options(sub, dtype=True)
    sub = commands.add_parser("verify", help="check a checkpoint's files against its checksums (offline)")
    sub.add_argument("path", help="a checkpoint (DCP step, HF export, DeepSpeed tag) or a directory holding several")
    for name, sub in commands.choices.items():
        sub.set_defaults(run=name.replace("-", "_"))  # the conversions function of its name
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # before the conversions import torch: --help and usage errors answer at once
    from glm45v_fsdp.checkpoint import conversions

    try:
        return getattr(conversions, args.run)(args)
    except UserError as error:
        print(f"convert: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
