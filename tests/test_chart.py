"""The benchmark charts (glm45v_fsdp/bench/charts.py, matplotlib): each function writes a real PNG with both series'
colours, NaN/None values draw no bar (and are left out of the loss comparison), the relative-error axis turns
logarithmic for errors far below the reference line, and a missing matplotlib is a UserError naming the extra."""

import importlib.util
import math
import sys

import numpy as np
import pytest
from PIL import Image

from glm45v_fsdp.bench import charts as chart
from glm45v_fsdp.errors import UserError

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed (the test extra has it)"
)

BLUE, ORANGE, RED = (31, 119, 180), (255, 127, 14), (214, 39, 40)
CONFIGS = [
    "00_baseline",
    "01_chunk_loss",
    "02_recompute",
    "03_recompute_offload",
    "04_optimizer_offload",
    "05_param_offload",
    "06_ep_balance",
    "07_fused_ops",
    "08_zero3",
    "09_context_parallel",
    "10_full_ulysses",
]


def colour_pixels(path, rgb, tolerance=12, half=None):
    """How many pixels of the PNG at `path` (or of its left or right half) are within `tolerance` (per channel) of
    `rgb`."""
    with Image.open(path) as image:
        assert image.format == "PNG"
        pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    middle = pixels.shape[1] // 2
    pixels = {None: pixels, "left": pixels[:, :middle], "right": pixels[:, middle:]}[half]
    return int((np.abs(pixels - np.array(rgb, dtype=np.int16)) <= tolerance).all(axis=-1).sum())


def png_size(path):
    with Image.open(path) as image:
        assert image.format == "PNG"
        return image.size


@needs_matplotlib
def test_bar_chart_draws_each_group_in_its_own_panel_with_both_colours(tmp_path):
    path = chart.bar_chart(
        [("ChunkLoss off→static", [12.5, 7.25]), ("recompute", [0.0123, 0.0081]), ("ep", [4812.0, 2406.0])],
        series=("OFF", "ON"),
        title="Peak memory (GiB; each switch on its own scale)",
        value_format="{:.3f}",
        notes=["saving +42.0%\ntime +3.1%", "saving +34.1%", "x0.50"],
        path=tmp_path / "sub" / "memory.png",
    )
    assert path == tmp_path / "sub" / "memory.png"
    width, height = png_size(path)
    assert width >= 640 and height >= 400  # the memory bench's test asks for >= 640 px
    # Own panels: the 0.01-GiB group's bars are as tall as the 12-GiB group's (on one axis they would be ~1 px).
    assert colour_pixels(path, BLUE) > 3 * 2000 and colour_pixels(path, ORANGE) > 3 * 1000


@needs_matplotlib
def test_bar_chart_on_a_shared_scale_and_with_a_third_series(tmp_path):
    groups = [("a", [2.0, 1.0]), ("b", [300.0, 250.0])]  # blue is the taller bar of both
    own = chart.bar_chart(groups, ("OFF", "ON"), "own", tmp_path / "own.png")
    shared = chart.bar_chart(groups, ("OFF", "ON"), "shared", tmp_path / "shared.png", shared_scale=True)
    # Own panels: group a's blue bar (left half) is as tall as group b's (right half); on one axis it is a sliver.
    assert 0.7 < colour_pixels(own, BLUE, half="left") / colour_pixels(own, BLUE, half="right") < 1.4
    assert colour_pixels(shared, BLUE, half="left") < 0.1 * colour_pixels(shared, BLUE, half="right")
    three = chart.bar_chart(
        [("ZeRO-1 fp32: samples/s", [50.0, 40.0, 50.0])],
        ("DeepSpeed", "engine API", "trainer"),
        "ds",
        tmp_path / "3.png",
    )
    assert colour_pixels(three, (44, 160, 44)) > 1000  # the third series is green


@needs_matplotlib
def test_bar_chart_draws_no_bar_for_nan_or_none(tmp_path):
    both = chart.bar_chart([("g", [10.0, 10.0])], ("OFF", "ON"), "both", tmp_path / "both.png")
    nan = chart.bar_chart([("g", [10.0, math.nan])], ("OFF", "ON"), "nan", tmp_path / "nan.png")
    none = chart.bar_chart([("g", [10.0, None])], ("OFF", "ON"), "none", tmp_path / "none.png")
    bar = colour_pixels(both, ORANGE) - colour_pixels(nan, ORANGE)
    assert bar > 5000  # the orange bar is gone (the legend's swatch stays)
    assert colour_pixels(none, ORANGE) == colour_pixels(nan, ORANGE)
    assert colour_pixels(nan, BLUE) > 5000


def test_value_labels_read_as_numbers():
    assert chart._value_text("{:.3g}", 4812.0) == "4812"  # not 4.81e+03
    assert chart._value_text("{:.3g}", 0.0123) == "0.0123"
    assert chart._value_text("{:.3f}", 7.25) == "7.250"


@needs_matplotlib
def test_config_bars_one_group_per_configuration(tmp_path):
    off = [812.0, 805.0, 830.0, 1240.0, 990.0, 1530.0, 801.0, 790.0, 845.0, 1010.0, 1102.0]
    on = [812.0, 790.5, 1010.0, 1650.0, 1120.0, math.nan, 780.0, 702.0, 900.0, 1200.0, None]
    path = chart.config_bars(CONFIGS, [off, on], ["OFF", "ON"], "ms per iteration", "ms/iter", tmp_path / "ms.png")
    width, height = png_size(path)
    assert width >= 1000 and height >= 400
    assert colour_pixels(path, BLUE) > 11 * 300 and colour_pixels(path, ORANGE) > 9 * 300
    single = chart.config_bars(CONFIGS, [off], ["max-rank"], "memory", "GiB", tmp_path / "one.png")
    assert colour_pixels(single, BLUE) > 11 * 300 and colour_pixels(single, ORANGE) == 0
    with pytest.raises(ValueError, match="11 labels"):
        chart.config_bars(CONFIGS, [off[:5]], ["OFF"], "t", "ms", tmp_path / "bad.png")
    with pytest.raises(ValueError, match="series names"):
        chart.config_bars(CONFIGS, [off, on], ["OFF"], "t", "ms", tmp_path / "bad.png")


def test_relative_errors_and_the_axis_scale():
    assert chart.relative_errors_pct([2.0, 4.0], [2.0, 4.2]) == pytest.approx([0.0, 5.0])
    tiny = chart.relative_errors_pct([3.0] * 5, [3.0 * (1 + 1e-8)] * 5)  # 1e-6 %
    assert tiny == pytest.approx([1e-6] * 5, rel=1e-3)
    assert chart.error_axis_scale(tiny, 2.0) == "log"
    assert chart.error_axis_scale([0.0, *tiny], 2.0) == "log"
    assert chart.error_axis_scale([0.5, 1.2, 0.01], 2.0) == "linear"  # near the line: linear shows it as it is
    assert chart.error_axis_scale([0.0, 0.0], 2.0) == "linear"  # nothing to put on a log axis
    assert chart.error_axis_scale([3.0, 1e-9], 2.0) == "linear"


def fake_losses(noise):
    steps = list(range(1, 201))
    reference = [4.0 * math.exp(-s / 60) + 1.5 for s in steps]
    test = [r * (1 + noise * (-1) ** s) for s, r in zip(steps, reference)]
    return steps, reference, test


@needs_matplotlib
def test_loss_comparison_chart_uses_a_log_axis_for_tiny_errors(tmp_path, monkeypatch):
    scales = []
    original = chart.error_axis_scale
    monkeypatch.setattr(chart, "error_axis_scale", lambda *args: scales.append(original(*args)) or scales[-1])
    steps, reference, test = fake_losses(1e-8)
    tiny = chart.loss_comparison_chart(steps, reference, test, "baseline", "all switches", "tiny", tmp_path / "t.png")
    steps, reference, test = fake_losses(1e-2)
    big = chart.loss_comparison_chart(steps, reference, test, "baseline", "all switches", "1%", tmp_path / "b.png")
    assert scales == ["log", "linear"]
    for path in (tiny, big):
        width, height = png_size(path)
        assert width >= 800 and height >= 600
        assert colour_pixels(path, BLUE) > 300 and colour_pixels(path, ORANGE) > 300  # the curves, not only legends
        assert colour_pixels(path, RED) > 500  # the reference line is drawn on both axes


@needs_matplotlib
def test_loss_comparison_chart_leaves_out_skipped_steps(tmp_path, monkeypatch):
    steps, reference, test = fake_losses(1e-8)
    reference[10], test[50], test[60] = None, None, math.nan
    seen = []
    original = chart.relative_errors_pct
    monkeypatch.setattr(chart, "relative_errors_pct", lambda r, t: seen.append(len(r)) or original(r, t))
    path = chart.loss_comparison_chart(steps, reference, test, "a", "b", "skipped", tmp_path / "skip.png")
    assert seen == [197] and png_size(path)[0] >= 800
    with pytest.raises(ValueError, match="differ in length"):
        chart.loss_comparison_chart(steps, reference, test[:-1], "a", "b", "t", tmp_path / "bad.png")
    none = chart.loss_comparison_chart([1, 2], [None, 1.0], [1.0, None], "a", "b", "empty", tmp_path / "none.png")
    assert png_size(none)[0] >= 800  # nothing to compare: still a chart that says so


def test_missing_matplotlib_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    calls = [
        lambda: chart.bar_chart([("g", [1.0, 2.0])], ("OFF", "ON"), "t", tmp_path / "a.png"),
        lambda: chart.config_bars(["x"], [[1.0]], ["OFF"], "t", "ms", tmp_path / "b.png"),
        lambda: chart.loss_comparison_chart([1], [1.0], [1.0], "a", "b", "t", tmp_path / "c.png"),
        chart.require_matplotlib,
    ]
    for call in calls:
        with pytest.raises(UserError, match=r"pip install 'glm45v-fsdp\[bench\]'.*pip install matplotlib"):
            call()
    assert not list(tmp_path.iterdir())
