"""`python -m glm45v_fsdp.tools.plan` (issue 32): the search for GLM-4.5V 106B on 16 x 8 devices, --explain, the
memory it reports against preflight's for the same overrides, what it says of a layout that does not fit, bad input,
and the calibration and validation commands on this machine (their figures are a benchmark's: docs/planning.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, bench_runs_forked, clean_env

from glm45v_fsdp.errors import UserError
from glm45v_fsdp.tools import plan, preflight

CONFIG = str(REPO / "configs" / "glm45v_106b_sft.yaml")
JOB = ["--config", CONFIG, "--nodes", "16", "--nproc-per-node", "8", "--tokens", "8192", "--global-batch", "128"]


def run_plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = plan.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_preflight(capsys, *argv: str) -> tuple[int, str, str]:
    code = preflight.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


DS_EXAMPLE = REPO / "configs" / "ds_config_glm45v_106b_sft.json"
SEARCHES = {
    "910b": [*JOB, "--device", "910b", "--json", "--top", "20"],
    "h100": [*JOB, "--device", "h100", "--json", "--top", "20"],
    "deepspeed": [*JOB, "--device", "910b", "--json", "--deepspeed", str(DS_EXAMPLE)],
}


@pytest.fixture(scope="module")
def searches(tmp_path_factory) -> dict:
    """The JSON reports of the searches the tests below share, started at once (each is one busy process)."""
    out = tmp_path_factory.mktemp("searches")
    started = {}
    for name, argv in SEARCHES.items():
        with (out / f"{name}.json").open("w") as stdout, (out / f"{name}.err").open("w") as stderr:
            started[name] = subprocess.Popen([sys.executable, "-m", "glm45v_fsdp.tools.plan", *argv], cwd=REPO,
                                             env=clean_env(), stdout=stdout, stderr=stderr, text=True)  # fmt: skip
    found = {}
    for name, process in started.items():
        assert process.wait(timeout=600) == 0, (out / f"{name}.err").read_text()[-3000:]
        found[name] = json.loads((out / f"{name}.json").read_text())
    return found


@pytest.fixture(scope="module")
def searched(searches) -> dict:
    """One search on 910B and one on H100 (JSON), shared by the tests below."""
    return {device: searches[device] for device in ("910b", "h100")}


def test_search_ranks_fitting_layouts_and_places_the_config_layout(searched):
    for device, report in searched.items():
        assert report["job"]["world"] == 128 and report["evaluated"] > 10000 and 0 < report["fitting"]
        top = report["top"]
        assert all(row["fits"] and row["gib_per_rank"] <= report["usable_gib"] for row in top)
        times = [row["ms_per_step"] for row in top]
        assert times[0] == min(times) and all(b >= a * (1 - 0.005) for a, b in zip(times, times[1:]))  # ties: 0.5%
        best = top[0]
        assert 0 < best["mfu"] < 1 and best["tokens_per_s_per_device"] > 0
        assert "compute" in best["dominant"] and best["across_nodes"]  # 16 nodes: FSDP's groups cross them
        # the shipped config's layout (EP 8 inside a node, full recompute, dynamic chunk loss) fits and is among
        # the fastest: within the 0.5% the model does not tell apart from the best
        own = report["config_layout"]
        assert own["fits"] and own["rank"] >= 1 and own["ms_per_step"] <= best["ms_per_step"] * 1.005, (device, own)
        assert "parallel.expert_parallel_size=8" in best["overrides"]


def test_best_layout_memory_is_preflights(searched, capsys):
    """The planner's GiB of its best layout = preflight's largest rank for the same overrides (one estimator)."""
    best = searched["910b"]["top"][0]
    code = preflight.main(["--config", CONFIG, "--world-size", "128", "--nproc-per-node", "8", "--json",
                           "--device-memory-gib", "60", *best["overrides"]])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    report = json.loads(out)
    assert not report["errors"]
    assert report["memory"]["max"]["total"] / 2**30 == pytest.approx(best["gib_per_rank"], abs=0.006)


def test_explain_prints_every_term_and_what_makes_a_layout_fit(capsys):
    layout = "ep8-uly1-ring1-rep1-rc_off-loss_off-unit_default-mb1"
    code, out, err = run_plan(capsys, *JOB, "--device", "910b", "--explain", layout, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert not report["fits"] and report["memory_gib"]["activations"] > report["usable_gib"]
    families = {c["family"] for c in report["collectives"]}
    assert {"fsdp", "efsdp", "ep"} <= families
    # dp = the whole job: the step's loss, tokens and the next step's valid tokens and data-error flag ride in the
    # gradient norm's all-reduce (one float64 partial sum and the four scalars): no data-parallel all-reduce
    assert "dp" not in families
    norm = next(c for c in report["collectives"] if c["family"] == "fsdp" and c["kind"] == "all_reduce")
    assert norm["bytes"] == (1 + 4) * 8 and norm["calls"] == 1
    assert all(c["ms"] >= 0 and c["bytes"] >= 0 for c in report["collectives"])
    assert report["step_ms"]["compute"] > 0 and report["ms_per_step"] > 0
    fixes = {fix["change"] for fix in report["remedies"]["fits_with"]}
    assert "recompute full" in fixes and report["remedies"]["over_gib"] > 0
    code, out, _ = run_plan(capsys, *JOB, "--device", "910b", "--explain", layout)
    assert code == 0 and "does not fit by" in out and "collectives per step per rank:" in out


def test_bad_input_is_one_clear_error(capsys, tmp_path):
    code, _, err = run_plan(capsys, *JOB, "--explain", "ep8-nonsense")
    assert code == 2 and "is not a layout name" in err
    code, _, err = run_plan(capsys, *JOB, "--custom", "warp_speed=9")
    assert code == 2 and "unknown field" in err and "inter_gbps" in err
    code, _, err = run_plan(capsys, *JOB, "--device", "cpu", "--calibration", str(tmp_path / "none.json"))
    assert code == 2 and "--calibrate" in err
    code, _, err = run_plan(capsys, *JOB, "--explain", "ep3-uly1-ring1-rep1-rc_off-loss_off-unit_default-mb1")
    assert code == 2 and "do not divide" in err


def test_custom_fields_change_the_model(capsys):
    layout = "ep8-uly1-ring1-rep1-rc_full-loss_dynamic-unit_default-mb1"
    times = []
    for custom in ("", "inter_gbps=50"):
        code, out, err = run_plan(capsys, *JOB, "--explain", layout, "--json", "--custom", custom)
        assert code == 0, err
        times.append(json.loads(out)["comm_ms"]["fsdp"])
    assert times[1] == pytest.approx(times[0] / 2, rel=0.01)  # FSDP crosses nodes: twice the NIC, half the time


def test_calibrate_and_validate_run_here(tmp_path, capsys):
    calibration = tmp_path / "cpu.json"
    code, out, err = run_plan(capsys, "--calibrate", "--calibration", str(calibration))
    assert code == 0, err
    device = json.loads(calibration.read_text())["device"]
    assert device["fp32_tflops"] > 0 and device["intra_gbps"] > 0 and device["intra_latency_us"] > 0
    assert device["overlap"] is False and device["devices_per_node"] == 2
    with bench_runs_forked():  # the six layouts' runs forked by the suite's zygote
        code, out, err = run_plan(capsys, "--validate", "--calibration", str(calibration), "--steps", "3",
                                  "--repeats", "1", "--out", str(tmp_path / "validate"))  # fmt: skip
    assert code == 0, err
    report = json.loads((tmp_path / "validate" / "plan_validate.json").read_text())
    assert len(report["rows"]) == 6
    assert sorted(r["model_rank"] for r in report["rows"]) == list(range(1, 7))
    assert all(r["modelled_ms"] > 0 and r["measured_ms"] > 0 for r in report["rows"])


# --deepspeed: the layout a ds_config runs (translated as `python -m glm45v_fsdp.train --deepspeed` translates it)
TINY_JOB = ["--nodes", "1", "--nproc-per-node", "4", "--unit-mib", "default", "--json"]


def write_ds_config(path, **sections) -> str:
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, **sections}))
    return str(path)


@pytest.fixture(scope="module")
def ds_example(searches) -> dict:
    return searches["deepspeed"]


def test_deepspeed_example_runs_the_best_layout(searched, ds_example):
    """configs/ds_config_glm45v_106b_sft.json (ZeRO-3, AutoEP 8, activation checkpointing, the extension's dynamic
    chunk loss) fixes the layout the search without --deepspeed ranks first, with its figures."""
    layout, search, best = ds_example["layout"], ds_example["search"], searched["910b"]["top"][0]
    assert layout["layout"] == best["layout"] == search["best"]["layout"] and search["place"] == 1
    assert layout["fits"] and layout["memory_gib"]["total"] == pytest.approx(best["gib_per_rank"], abs=0.006)
    assert layout["ms_per_step"] == best["ms_per_step"] and search["time_vs_best"] == 1
    for switched in ("parallel.expert_parallel_size=8", "features.recompute.granularity=full",
                     "features.chunk_loss.mode=dynamic"):  # fmt: skip
        assert switched in layout["overrides"]
    summary = ds_example["deepspeed"]
    assert summary["zero_stage"] == 3 and summary["precision"] == "bf16"
    assert all(row["value"] == row["engine_api"] for row in summary["left_open"])  # both doors run this layout


def test_deepspeed_memory_is_preflights(ds_example, capsys):
    code = preflight.main(["--config", CONFIG, "--world-size", "128", "--nproc-per-node", "8", "--json",
                           "--device-memory-gib", "60", "--deepspeed", str(DS_EXAMPLE)])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    memory = json.loads(out)["memory"]
    assert memory["max"]["total"] / 2**30 == pytest.approx(ds_example["layout"]["memory_gib"]["total"], abs=0.001)


def test_deepspeed_layout_that_does_not_fit_is_explained(tmp_path, capsys):
    """EP 1 (the YAML's 8 overridden: the ds_config's disabled AutoEP leaves it open) and no chunked loss: every term
    as --explain prints it, the switches that make it fit, and how far the best layout is."""
    example = json.loads(DS_EXAMPLE.read_text())
    example["expert_parallel"] = {"enabled": False}
    example["glm45v_fsdp"] = {"features": {"chunk_loss": {"mode": "off"}}}
    (tmp_path / "ds.json").write_text(json.dumps(example))
    code, out, err = run_plan(capsys, *JOB, "--device", "910b", "--json", "--unit-mib", "default",
                              "--deepspeed", str(tmp_path / "ds.json"), "parallel.expert_parallel_size=1")  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    layout = report["layout"]
    assert layout["layout"] == "ep1-uly1-ring1-rep1-rc_full-loss_off-unit_512-mb1"
    assert not layout["fits"] and layout["remedies"]["over_gib"] > 0 and layout["remedies"]["fits_with"]
    assert report["search"]["place"] == 0 and report["search"]["time_vs_best"] > 2
    open_keys = {row["key"]: row for row in report["deepspeed"]["left_open"]}
    assert open_keys["parallel.expert_parallel_size"]["from"] == "command line"
    code, out, err = run_plan(capsys, *JOB, "--device", "910b", "--json", "--explain", layout["layout"])
    assert code == 0, err
    assert json.loads(out) == layout  # the same terms as --explain of that layout


@pytest.mark.parametrize(
    "sections, part",
    [
        ({"expert_parallel": {"enabled": True, "autoep_size": 2}}, "ep2-"),
        ({"activation_checkpointing": {"partition_activations": False}}, "-rc_full-"),
        ({"glm45v_fsdp": {"features": {"chunk_loss": {"mode": "dynamic"}}}}, "-loss_dynamic-"),
        ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 2**25}}, "-unit_128-"),
        ({"train_micro_batch_size_per_gpu": 2}, "-mb2"),
    ],
)
def test_deepspeed_keys_switch_the_reported_layout(tmp_path, capsys, sections, part):
    code, out, err = run_plan(capsys, *TINY_JOB, "--deepspeed", write_ds_config(tmp_path / "base.json"))
    assert code == 0, err
    base = json.loads(out)["layout"]["layout"]
    code, out, err = run_plan(capsys, *TINY_JOB, "--deepspeed", write_ds_config(tmp_path / "ds.json", **sections))
    assert code == 0, err
    report = json.loads(out)
    assert part in report["layout"]["layout"] and part not in base
    assert report["search"]["place"] >= 1 and report["search"]["evaluated"] > 100


def test_deepspeed_auto_batch_and_open_keys_are_named(tmp_path, capsys):
    """An "auto" micro batch takes the YAML's (here the command line's), a layout key the ds_config leaves open keeps
    the YAML's value, and the text says both, with the value deepspeed.initialize (no YAML) runs instead."""
    ds = write_ds_config(tmp_path / "ds.json", train_micro_batch_size_per_gpu="auto")
    code, out, err = run_plan(capsys, *TINY_JOB[:-1], "--deepspeed", ds, "training.micro_batch_size=2",
                              "parallel.expert_parallel_size=2")  # fmt: skip
    assert code == 0, err
    assert '"auto" filled: train_micro_batch_size_per_gpu: auto -> 2 (training.micro_batch_size)' in out
    assert "parallel.expert_parallel_size=2 from the command line (deepspeed.initialize runs 1)" in out
    assert "the layout it runs:\nlayout ep2-uly1-ring1-rep1-rc_off-loss_off-unit_190.735-mb2 on 4 ranks" in out
    assert "memory per rank" in out and "of the fitting layouts" in out and "the best layout ep" in out


def test_deepspeed_bad_config_is_the_trainer_doors_error(tmp_path, capsys):
    from ds_compat.trainer_door import configure
    from glm45v_fsdp.config import load_config

    cases = {
        "expert_parallel.autoep_size": {"expert_parallel": {"enabled": True, "autoep_size": 3}},
        "features.chunk_los": {"glm45v_fsdp": {"features": {"chunk_los": {"mode": "dynamic"}}}},
    }
    for key, sections in cases.items():
        ds = write_ds_config(tmp_path / "bad.json", **sections)
        with pytest.raises(UserError) as door:
            configure(ds, load_config(None), [], 4)
        code, out, err = run_plan(capsys, *TINY_JOB, "--deepspeed", ds)
        assert code == 2 and out == "" and err == f"plan: error: {door.value}\n" and key in err
        code, _, err = run_preflight(capsys, "--world-size", "4", "--deepspeed", ds)
        assert code == 2 and err == f"preflight: error: {door.value}\n"
    code, _, err = run_plan(capsys, *TINY_JOB, "--deepspeed", write_ds_config(tmp_path / "ds.json"),
                            "--global-batch", "8")  # fmt: skip
    assert code == 2 and "--global-batch 8 differs from the global batch 4" in err
    code, _, err = run_plan(capsys, *TINY_JOB, "--deepspeed", ds, "--explain", "ep1")
    assert code == 2 and "pass one of them" in err


def test_videos_add_their_patches_to_the_vision_work(capsys):
    """--videos-per-sample / --video-frames count the videos' temporal patches as the preflight does: on Ulysses 2 the
    rank with the larger share encodes 1 image of 16 patches without videos, and 9 items of 16 patches (of 2 images
    + 2 x 4 temporal patches, x micro batch 2, over 2 ranks) with two 8-frame videos: 9x the vision matmul FLOPs."""
    layout = "ep1-uly2-ring1-rep1-rc_full-loss_static-unit_default-mb2"
    flops = {}
    for videos in ("0", "2"):
        code, out, err = run_plan(capsys, *TINY_JOB, "--videos-per-sample", videos, "--video-frames", "8",
                                  "--explain", layout)  # fmt: skip
        assert code == 0, err
        flops[videos] = json.loads(out)["flops_per_micro_batch"]
    assert flops["2"]["vision matmuls"] == 9 * flops["0"]["vision matmuls"]
    assert flops["2"]["text matmuls"] == flops["0"]["text matmuls"]  # the tokens stay data.cutoff_len
    code, _, err = run_plan(capsys, *TINY_JOB, "--video-frames", "0")
    assert code == 2 and "--video-frames = 0 is invalid" in err
