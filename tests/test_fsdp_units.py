"""Size-based FSDP2 units (`parallel.fsdp_plan.unit_mib`): which modules are merged into one unit, and that merging
changes no figure of training (2 gloo ranks, fp32, against one unit per module)."""

from __future__ import annotations

from conftest import PARITY, mean_relative_error, read_metrics, train
from torch import nn

from glm45v_fsdp.module_patterns import match_modules
from glm45v_fsdp.parallel.fsdp import set_prefetch, unit_groups


def model_of(layer_params: list[int]) -> nn.Module:
    """A root with `layers` (linear layers of the given parameter counts, fp32) and a `head` with a nested `inner`."""
    root = nn.Module()
    root.layers = nn.ModuleList(nn.Linear(n, 1, bias=False) for n in layer_params)
    root.head = nn.Sequential()
    root.head.inner = nn.Linear(2**18, 1, bias=False)  # 1 MiB
    return root


def groups(model: nn.Module, patterns: list[str], unit_mib: float, alone=frozenset(), required=frozenset()):
    matches = match_modules(model, patterns, "parallel.fsdp_plan.apply_modules")
    return unit_groups(model, matches, set(alone), unit_mib, required=set(required))


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
    # a required module (run outside its parent's forward) below the unit size stays a unit only inside another unit
    head = ["head", "head.inner"]
    assert groups(model, head, 1.5, alone={"head.inner"}, required={"head.inner"}) == []
    assert groups(model, head, 0.5, alone={"head.inner"}, required={"head.inner"}) == [["head"], ["head.inner"]]
    assert groups(model, ["head.inner"], 1.5, alone={"head.inner"}) == [["head.inner"]]  # an expert stack: always
    # required units stay alone whatever their size and cut the run; patterns never merge with each other; nesting
    # is never merged
    assert groups(model, ["layers.{*}", "head", "head.inner"], 1, alone={"layers.3"}) == [
        # layers.0-2 (0.75 MiB) are cut off by layers.3 before they fill a unit: they stay with the root
        ["layers.3"],
        ["layers.4", "layers.5", "layers.6"],
        ["head"],
        ["head.inner"],
    ]


class RecordingUnit(nn.Linear):
    """Stands in for an FSDP2 unit: records the prefetch lists it is given (by module name)."""

    def set_modules_to_forward_prefetch(self, modules):
        self.forward_prefetch = [module.name for module in modules]

    def set_modules_to_backward_prefetch(self, modules):
        self.backward_prefetch = [module.name for module in modules]


def test_prefetch_follows_each_patterns_units():
    root = nn.Module()
    root.layers = nn.ModuleList(RecordingUnit(1, 1) for _ in range(4))
    root.head = RecordingUnit(1, 1)
    for name, module in root.named_modules():
        module.name = name
    matches = match_modules(root, ["layers.{*}", "head"], "parallel.fsdp_plan.apply_modules")
    units = [["layers.0", "layers.1"], ["layers.2"], ["layers.3"], ["head"]]  # layers.1 merged into layers.0's unit
    set_prefetch(root, matches, units, depth=2)
    first, _, third, last = root.layers
    assert first.forward_prefetch == ["layers.2", "layers.3"] and not hasattr(first, "backward_prefetch")
    assert third.forward_prefetch == ["layers.3"] and third.backward_prefetch == ["layers.0"]
    assert last.backward_prefetch == ["layers.2", "layers.0"] and not hasattr(last, "forward_prefetch")
    assert not hasattr(root.head, "forward_prefetch") and not hasattr(root.head, "backward_prefetch")  # alone


def test_merged_units_train_like_one_unit_per_module(tmp_path):
    """Both ZeRO styles (reshard after forward or not) with every layer pattern merged into one unit, the cpu
    default unit size, and explicit prefetch over one unit per module."""
    runs = {}
    per_module = ["parallel.fsdp_plan.unit_mib=0"]
    for name, extra in {
        "per_module": per_module,
        "merged": ["parallel.fsdp_plan.unit_mib=1000"],
        "merged_keep": ["parallel.fsdp_plan.unit_mib=1000", "parallel.fsdp_plan.reshard_after_forward=false"],
        "cpu_default": [],
        "prefetch": [*per_module, "parallel.fsdp_plan.prefetch=2"],
    }.items():
        result = train(tmp_path / name, PARITY + extra, nproc=2)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.count("[plan fsdp]") == 1  # what is sharded and how, said once
        if name.startswith("merged"):  # the whole model is the root unit (model.visual too: no unit encloses it)
            assert (
                "[plan fsdp] 5 pattern(s); fully_shard over 2 rank(s): all 9 planned module(s) below unit_mib "
                "1000, so none is a unit of its own" in result.stdout
            )
        if name == "cpu_default":
            assert "all 9 planned module(s) below unit_mib 32, the cpu default, so none" in result.stdout
        if name == "per_module":
            assert "fully_shard over 2 rank(s): one unit per planned module (9), then the root" in result.stdout
        if name == "prefetch":
            assert "; prefetch 2 unit(s) ahead in forward and backward along each pattern" in result.stdout
        runs[name] = read_metrics(tmp_path / name)
    for name in ("merged", "merged_keep", "cpu_default", "prefetch"):
        for key in ("loss", "grad_norm"):
            reference = [r[key] for r in runs["per_module"]]
            assert mean_relative_error([r[key] for r in runs[name]], reference) < 1e-6, (name, key)
