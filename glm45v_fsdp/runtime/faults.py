"""A test knob that makes a rank fail at one step: GLM45V_FAULT="RANK:STEP:KIND[:MARKER]" (RANK `*`: every rank).

KIND, after step STEP is recorded on rank RANK:
  - `exception`: a RuntimeError;
  - `sigkill`: os.kill(getpid(), SIGKILL) (an out-of-memory kill looks the same);
  - `sigterm`: SIGTERM then SIGUSR1 to itself (a preemption, and a second signal during the save);
  - `hang`: the rank blocks forever in its data loader's next fetch (a deadlocked loader; it stays alive);
  - `data_error`: the rank's next fetch fails with a data error (a record that cannot be read);
  - `skip_collective`: the rank leaves out the next step's per-step all-gather of figures (a collective a peer never
    enters).
Or, during step STEP:
  - `nan`: the step's loss on rank RANK becomes NaN (its gradients too);
  - `sigkill_save`: SIGKILL inside the checkpoint save of step STEP, after its files are written (with async_save:
    staged) and before it is published; with RANK `*`, a `kill -9` of the whole job mid-save.
With MARKER (a file path) it fires only while that file does not exist, and creates it first, so a restarted job
(torchrun --max-restarts, Slurm --requeue) runs on. For tests and drills only.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from glm45v_fsdp.errors import UserError
from glm45v_fsdp.log import get_logger

ENV_FAULT = "GLM45V_FAULT"
KINDS = ("exception", "sigkill", "sigterm", "sigkill_save", "nan", "hang", "data_error", "skip_collective")


@dataclass(frozen=True)
class Fault:
    rank: int | None  # None: every rank
    step: int
    kind: str
    marker: Path | None

    @classmethod
    def from_env(cls, environ: dict[str, str] | os._Environ = os.environ) -> Fault | None:
        value = environ.get(ENV_FAULT)
        if not value:
            return None
        parts = value.split(":", 3)
        rank_ok = len(parts) >= 3 and (parts[0].isdigit() or parts[0] == "*")
        if not rank_ok or not parts[1].isdigit() or parts[2] not in KINDS:
            raise UserError(
                f"{ENV_FAULT}={value!r} is not RANK:STEP:KIND[:MARKER] with KIND one of {', '.join(KINDS)} "
                f"(e.g. {ENV_FAULT}=1:5:sigkill). Unset it to train normally."
            )
        rank = None if parts[0] == "*" else int(parts[0])
        return cls(rank, int(parts[1]), parts[2], Path(parts[3]) if len(parts) == 4 else None)

    def loss_factor(self, rank: int, step: int) -> float:
        """1.0, or NaN for the `nan` fault's rank and step (the trainer multiplies the step's loss by it)."""
        hit = self.kind == "nan" and self.rank in (None, rank) and step == self.step
        return float("nan") if hit else 1.0

    def hits(self, kind: str, rank: int, step: int) -> bool:
        """Whether the fault of `kind` applies to this rank after step `step` (the hooks of `hang`, `data_error`
        and `skip_collective`, which act where the loader and the collective are)."""
        if self.kind != kind or self.rank not in (None, rank) or step != self.step:
            return False
        if self.marker is not None:
            if self.marker.exists():
                return False
            self.marker.touch()
        return True

    def maybe_fire(self, rank: int, step: int, in_save: bool = False) -> None:
        """Called after each step's record and (in_save) inside each checkpoint save."""
        if self.kind in ("nan", "hang", "data_error", "skip_collective") or (self.kind == "sigkill_save") != in_save:
            return
        if self.rank not in (None, rank) or step != self.step:
            return
        if self.marker is not None:
            if self.marker.exists():
                return
            self.marker.touch()
        get_logger().warning("%s: injecting %s on rank %d at step %d", ENV_FAULT, self.kind, rank, step)
        if self.kind == "exception":
            raise RuntimeError(f"{ENV_FAULT}: injected failure on rank {rank} after step {step}")
        if self.kind in ("sigkill", "sigkill_save"):
            os.kill(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR1)
