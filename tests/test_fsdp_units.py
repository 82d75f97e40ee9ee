"""Size-based FSDP2 units (`parallel.fsdp_plan.unit_mib`): which modules are merged into one unit, and that merging
changes no figure of training (2 gloo ranks, fp32, against one unit per module)."""

from __future__ import annotations

from conftest import PARITY, mean_relative_error, read_metrics, train
from torch import nn

from glm45v_fsdp.parallel.fsdp import unit_groups
from glm45v_fsdp.parallel.plan import match_modules


def model_of(layer_params: list[int]) -> nn.Module:
    """A root with `layers` (linear layers of the given parameter counts, fp32) and a `head` with a nested `inner`."""
    root = nn.Module()
    root.layers = nn.ModuleList(nn.Linear(n, 1, bias=False) for n in layer_params)
    root.head = nn.Sequential()
    root.head.inner = nn.Linear(2**18, 1, bias=False)  # 1 MiB
    return root


def groups(model: nn.Module, patterns: list[str], unit_mib: float, alone: set[str] = frozenset()) -> list[list[str]]:
    return unit_groups(model, match_modules(model, patterns, "parallel.fsdp_plan.apply_modules"), alone, unit_mib)


def test_consecutive_modules_merge_until_the_unit_size():
    quarter = 2**16  # 0.25 MiB of fp32 parameters
    model = model_of([quarter] * 6 + [4 * quarter, quarter])
    assert groups(model, ["layers.{*}"], 0) == [[f"layers.{i}"] for i in range(8)]  # 0: today's one unit each
    assert groups(model, ["layers.{*}"], 0.5) == [
        ["layers.0", "layers.1"],
        ["layers.2", "layers.3"],
        ["layers.4", "layers.5"],
        ["layers.6"],  # 1 MiB alone already reaches the size
        # layers.7 (0.25 MiB) cannot fill a unit: it stays with the root
    ]
    assert groups(model, ["layers.{*}"], 2.5) == [[f"layers.{i}" for i in range(7)]]  # 2.5 MiB; layers.7 to the root
    assert groups(model, ["layers.{*}"], 1000) == []  # the whole model is smaller than one unit: the root alone
    # required units stay alone whatever their size and cut the run; patterns never merge with each other; nesting
    # is never merged
    assert groups(model, ["layers.{*}", "head", "head.inner"], 1, alone={"layers.3"}) == [
        # layers.0-2 (0.75 MiB) are cut off by layers.3 before they fill a unit: they stay with the root
        ["layers.3"],
        ["layers.4", "layers.5", "layers.6"],
        ["head"],
        ["head.inner"],
    ]


def test_merged_units_train_like_one_unit_per_module(tmp_path):
    """Both ZeRO styles (reshard after forward or not) with every layer pattern merged into one unit."""
    runs = {}
    for name, extra in {
        "per_module": [],
        "merged": ["parallel.fsdp_plan.unit_mib=1000"],
        "merged_keep": ["parallel.fsdp_plan.unit_mib=1000", "parallel.fsdp_plan.reshard_after_forward=false"],
    }.items():
        result = train(tmp_path / name, PARITY + extra, nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        if extra:  # only model.visual (run outside the root forward) is a unit; the other 8 are below 1000 MiB
            assert (
                "FSDP units: 1 planned module(s) in 1 unit(s) (unit_mib 1000), 8 below the unit size left to the root"
                in result.stdout
            )
        runs[name] = read_metrics(tmp_path / name)
    for name in ("merged", "merged_keep"):
        for key in ("loss", "grad_norm"):
            reference = [r[key] for r in runs["per_module"]]
            assert mean_relative_error([r[key] for r in runs[name]], reference) < 1e-6, (name, key)
