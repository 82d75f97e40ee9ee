"""fp16 loss scaling: the scale follows DeepSpeed's DynamicLossScaler step for step, and fp16 training on 2 FSDP2
ranks skips overflowing steps, lowers the scale and trains like fp32."""

from __future__ import annotations

import random

import pytest
from conftest import PARITY, read_metrics, train

from glm45v_fsdp.config import LossScaleConfig
from glm45v_fsdp.errors import TrainingStopped
from glm45v_fsdp.loss_scale import LossScaler


@pytest.mark.parametrize(
    "window, hysteresis, consecutive, floor", [(3, 1, False, 1.0), (5, 2, False, 4.0), (4, 3, True, 1.0)]
)
def test_scale_follows_deepspeeds_dynamic_loss_scaler(monkeypatch, window, hysteresis, consecutive, floor):
    loss_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
    monkeypatch.setattr(loss_scaler.dist, "get_rank", lambda: 0)
    reference = loss_scaler.DynamicLossScaler(
        init_scale=2**10,
        scale_window=window,
        min_scale=floor,
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive,
        raise_error_at_min_scale=False,
    )
    ours = LossScaler(
        LossScaleConfig(
            initial_scale_power=10,
            window=window,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive,
            min_scale=floor,
        )
    )
    rng = random.Random(window * 10 + hysteresis)
    for step in range(300):
        overflow = rng.random() < (0.6 if step % 50 < 10 else 0.08)
        if overflow and ours.scale == floor and (hysteresis == 1 or ours.hysteresis_left == 1):
            overflow = False  # the floor stops our run, as DeepSpeed's default raise_error_at_min_scale does
        reference.update_scale(overflow)
        ours.update(overflow)
        assert ours.scale == reference.cur_scale, step
        assert ours.hysteresis_left == reference.cur_hysteresis, step


def test_overflow_at_the_floor_stops_and_state_round_trips():
    scaler = LossScaler(LossScaleConfig(initial_scale_power=1, hysteresis=1, min_scale=1.0))
    scaler.update(True)
    assert scaler.scale == 1.0
    copy = LossScaler(LossScaleConfig(initial_scale_power=1, hysteresis=1, min_scale=1.0))
    copy.load_state_dict(scaler.state_dict())
    assert copy.state_dict() == scaler.state_dict()
    with pytest.raises(TrainingStopped, match="minimum fp16 loss scale 1"):
        scaler.update(True)
    static = LossScaler(LossScaleConfig(static_scale=128))
    static.update(True)
    assert static.scale == 128 and not static.dynamic


def test_fp16_training_on_two_ranks_tracks_fp32_and_skips_overflows_as_deepspeed(tmp_path):
    steps = ["training.train_iters=6"]
    fp32 = train(tmp_path / "fp32", [*PARITY, *steps], nproc=2)
    fp16 = train(tmp_path / "fp16", [*PARITY, *steps, "parallel.fsdp_plan.param_dtype=fp16"], nproc=2)
    for result in (fp32, fp16):
        assert result.returncode == 0, result.stderr[-3000:]
    assert "fp16: dynamic loss scale from 65536" in fp16.stdout
    records = read_metrics(tmp_path / "fp16")
    assert not any(r["skipped"] for r in records) and {r["loss_scale"] for r in records} == {65536.0}
    reference = [r["loss"] for r in read_metrics(tmp_path / "fp32")]
    errors = [abs(r["loss"] - ref) / abs(ref) for r, ref in zip(records, reference, strict=True)]
    assert sum(errors) / len(errors) < 1e-3  # fp16 compute: about 3e-5 measured

    # 2**20 overflows this model's fp16 gradients: hysteresis 2 keeps the scale at the first overflow, then every
    # overflow halves it until the gradients fit; skipped steps move neither the weights nor the schedule.
    overflowing = [
        "training.train_iters=9",
        "parallel.fsdp_plan.param_dtype=fp16",
        "parallel.fsdp_plan.reduce_dtype=fp32",
        "training.loss_scale.initial_scale_power=20",
        "training.lr_scheduler=linear",
        "training.lr_warmup_ratio=0.5",
    ]
    result = train(tmp_path / "overflow", overflowing, nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fp16 gradient overflow at loss scale 1.04858e+06: step 1 skipped" in result.stdout
    records = read_metrics(tmp_path / "overflow")
    skipped = [r["skipped"] for r in records]
    scales = [r["loss_scale"] for r in records]
    lrs = [r["lr"] for r in records]
    first_good = skipped.index(False)
    assert first_good >= 2 and not any(skipped[first_good:])
    assert scales[:first_good] == [2.0**20] + [2.0 ** (20 - k) for k in range(1, first_good)]
    assert set(scales[first_good:]) == {scales[first_good - 1]}
    assert len(set(lrs[: first_good + 1])) == 1 and lrs[first_good + 1] > lrs[first_good]
