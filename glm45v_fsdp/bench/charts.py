"""Benchmark charts as PNG, drawn with matplotlib (the optional `bench` extra: `pip install 'glm45v-fsdp[bench]'`).

`bar_chart([(label, [v_series0, v_series1, ...]), ...], series=("OFF", "ON"), title=..., path=...)` draws one group
of bars per label, each bar's value above it, a legend, and under each group its label and optional note lines;
blue is the first series and orange the second, as in the reference report's figures. `shared_scale=False` (the
default) gives every group its own panel and y axis from 0, so a group whose values are 100x smaller than another's
still shows its OFF/ON ratio; `shared_scale=True` draws all groups on one axis.

`loss_comparison_chart(steps, reference, test, ...)` is the reference report's loss-comparison plot: the two loss
curves, and under them the per-step relative error in percent against a red reference line (a log axis when the
errors are far below the line, so errors of 1e-6 % stay readable).

`config_bars(labels, series_values, series_names, ...)` draws one group of 1-2 bars per configuration (e.g.
00_baseline ... 10_full_ulysses: OFF/ON ms per iteration, or max-rank/avg-rank memory) on one axis.

matplotlib is imported inside the functions, through its object API (Figure + the Agg canvas): no pyplot state is
shared between calls, and no display is needed. Without matplotlib they raise a UserError that says what to install;
`require_matplotlib()` lets a long benchmark check that before it runs.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from glm45v_fsdp.errors import UserError

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")  # blue, orange, green, red: matplotlib's first four
LIMIT_COLOR = "#d62728"
NA_COLOR = "#777777"
DPI = 100
# The relative-error axis turns logarithmic when every error is below this fraction of the limit line: on a linear
# axis they would be a flat line on 0.
LOG_BELOW_FRACTION_OF_LIMIT = 0.1


def require_matplotlib() -> None:
    """Raise the UserError the chart functions raise when matplotlib is missing; return if it is installed."""
    _matplotlib()


def _matplotlib() -> tuple[Any, Any]:
    """(Figure, FigureCanvasAgg), imported now; a UserError naming the extra if matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401  (first, so that a blocked or missing package fails here)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise UserError(
            f"the benchmark charts need matplotlib, which is not installed ({error}); install the bench extra with "
            "`pip install 'glm45v-fsdp[bench]'` (or `pip install matplotlib`) and run again."
        ) from None
    return Figure, FigureCanvasAgg


def _new_figure(width: float, height: float, title: str) -> Any:  # a SubFigure
    """A figure with `title` on top and the subfigure that holds the axes and the legend: constrained layout puts a
    legend "outside upper center" of the subfigure under the title (on the figure itself the two overlap)."""
    Figure, FigureCanvasAgg = _matplotlib()
    figure = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)  # the Agg canvas, explicitly: no pyplot, no interactive backend
    figure.suptitle(title, fontsize=13)
    return figure.subfigures(1, 1)


def _save(body: Any, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body.figure.savefig(path, format="png", dpi=DPI, facecolor="white")
    return path


def _number(value: float | None) -> float:
    """The value as a float; None (a skipped or missing figure) becomes NaN."""
    return math.nan if value is None else float(value)


def _tick_text(value: float, _position: Any = None) -> str:
    """Plain tick labels (no offset or 1e-3 factor at the top of the axis, which collides with the bar labels)."""
    if value == 0:
        return "0"
    return f"{value:.6g}"


def _value_text(value_format: str, value: float) -> str:
    """value_format applied, except that the exponent form of "{:.3g}" for thousands ("4.81e+03") reads as 4812."""
    text = value_format.format(value)
    if re.search(r"e\+0[3-5]$", text) and 1e3 <= abs(value) < 1e6:
        text = f"{value:.0f}"
    return text


def _wrap(text: str, width: int) -> str:
    """Each line of `text` wrapped at spaces to `width` characters (a longer word stays whole)."""
    lines = []
    for line in text.split("\n"):
        lines += textwrap.wrap(line, width=max(8, width), break_on_hyphens=False, break_long_words=False) or [""]
    return "\n".join(lines)


def _title_width(figure_width: float, fontsize: float) -> int:
    """Characters of a `fontsize` text that fit across `figure_width` inches (DejaVu Sans: about 0.58 em each)."""
    return int(figure_width * 72 / (fontsize * 0.58))


def _draw_bars(
    ax: Any,
    centers: Sequence[float],
    values: Sequence[Sequence[float]],
    bar_width: float,
    value_format: str,
    value_fontsize: float,
    na_fontsize: float,
) -> list[Any]:
    """values[s][g]: series s's bar of the group centred at centers[g]. NaN: no bar, "n/a" on the baseline.
    Returns one legend handle per series."""
    count = len(values)
    handles = []
    for s, series_values in enumerate(values):
        offset = (s - (count - 1) / 2) * bar_width
        xs = [center + offset for center in centers]
        heights = [v if math.isfinite(v) else 0.0 for v in series_values]
        bars = ax.bar(xs, heights, width=bar_width * 0.92, color=COLORS[s % len(COLORS)], zorder=2)
        handles.append(bars)
        labels = [_value_text(value_format, v) if math.isfinite(v) else "" for v in series_values]
        ax.bar_label(bars, labels=labels, padding=2, fontsize=value_fontsize, zorder=3)
        for x, v in zip(xs, series_values):
            if not math.isfinite(v):
                ax.annotate(
                    "n/a",
                    (x, 0),
                    xytext=(0, 3),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=na_fontsize,
                    color=NA_COLOR,
                    zorder=3,
                )
    return handles


def _value_axis(ax: Any, values: Sequence[float], headroom: float = 1.14) -> None:
    """The y axis from 0 (or below, for negative values) with room above the tallest bar for its label."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    finite = [v for v in values if math.isfinite(v)]
    high, low = max(finite + [0.0]), min(finite + [0.0])
    if high == low:
        high = 1.0
    span = high - low
    ax.set_ylim(low - (span * (headroom - 1) if low < 0 else 0.0), high + span * (headroom - 1))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.yaxis.set_major_formatter(FuncFormatter(_tick_text))
    ax.grid(axis="y", color="#dddddd", linewidth=0.8, zorder=0)
    ax.set_axisbelow(True)
    if low < 0:
        ax.axhline(0, color="#333333", linewidth=0.8, zorder=1)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def bar_chart(
    groups: Sequence[tuple[str, Sequence[float]]],
    series: Sequence[str],
    title: str,
    path: Path,
    value_format: str = "{:.3g}",
    notes: Sequence[str] = (),
    shared_scale: bool = False,
) -> Path:
    """Draw the grouped bars and write them to `path` (PNG); `notes[i]` (optional, may hold newlines) goes under
    group i's label. values[s] of a group is series s's bar (colours in COLORS order); a NaN or None value draws no
    bar and "n/a"."""
    groups = [(label, [_number(v) for v in values]) for label, values in groups]
    count = max([1, len(series)] + [len(values) for _, values in groups])
    if shared_scale:
        group_width = max(1.6, 0.55 * count + 0.5)
        width = max(7.0, 1.2 + len(groups) * group_width)
    else:
        group_width = max(2.3, 0.6 * count + 1.3)
        width = max(7.0, len(groups) * group_width)
    label_chars = int(0.85 * _title_width(group_width, 9))
    lines_under = [
        _wrap(label, label_chars) + (f"\n{notes[i]}" if i < len(notes) and notes[i] else "")
        for i, (label, _) in enumerate(groups)
    ]
    label_rows = max([text.count("\n") + 1 for text in lines_under] + [1])
    title_text = _wrap(title, _title_width(width, 13))
    height = 4.6 + 0.2 * label_rows + 0.25 * title_text.count("\n")
    body = _new_figure(width, height, title_text)
    bar_width = 0.8 / count
    if shared_scale:
        ax = body.subplots()
        centers = list(range(len(groups)))
        values = [[vs[s] if s < len(vs) else math.nan for _, vs in groups] for s in range(count)]
        handles = _draw_bars(ax, centers, values, bar_width, value_format, 9, 9)
        _value_axis(ax, [v for vs in values for v in vs])
        ax.set_xticks(centers, lines_under, fontsize=9)
        ax.tick_params(axis="x", length=0)
        ax.set_xlim(-0.6, len(groups) - 0.4)
    else:
        axes = body.subplots(1, max(1, len(groups)), squeeze=False)[0]
        handles = []
        for ax, (_, vs), text in zip(axes, groups, lines_under):
            padded = [[vs[s] if s < len(vs) else math.nan] for s in range(count)]
            handles = _draw_bars(ax, [0.0], padded, bar_width, value_format, 9, 9)
            _value_axis(ax, vs)
            ax.set_xticks([])
            ax.set_xlim(-0.55, 0.55)
            ax.set_xlabel(text, fontsize=9)
            ax.tick_params(axis="y", labelsize=8)
    if handles:
        body.legend(
            handles[: len(series)], list(series), loc="outside upper center", ncol=max(1, len(series)), frameon=False
        )
    return _save(body, path)


def relative_errors_pct(reference: Sequence[float], test: Sequence[float]) -> list[float]:
    """Per step: |test - ref| / (|ref| + 1e-8) in percent, the benches' loss-parity measure (runner.py's)."""
    from glm45v_fsdp.bench.runner import relative_errors

    return [100.0 * error for error in relative_errors(test, reference)]


def error_axis_scale(errors_pct: Sequence[float], limit_pct: float) -> str:
    """The relative-error axis: "log" when every error is far below the limit line (below LOG_BELOW_FRACTION_OF_LIMIT
    of it) and some error is not 0, so that e.g. 1e-6 % errors are not a flat line on 0; otherwise "linear"."""
    finite = [e for e in errors_pct if math.isfinite(e)]
    if not any(e > 0 for e in finite):
        return "linear"
    return "log" if max(finite) < LOG_BELOW_FRACTION_OF_LIMIT * limit_pct else "linear"


def loss_comparison_chart(
    steps: Sequence[int],
    reference: Sequence[float | None],
    test: Sequence[float | None],
    reference_label: str,
    test_label: str,
    title: str,
    path: Path,
    limit_pct: float = 2.0,
) -> Path:
    """Top: the reference (blue) and test (orange, dashed, so both show where they coincide) loss over the steps.
    Bottom, same x: the per-step relative error |test - ref| / (|ref| + 1e-8) in percent, with a red line at
    `limit_pct`; a log axis when the errors are far below the line (`error_axis_scale`). The title gives the mean and
    max relative error. Steps where either loss is None or not finite are left out (the title counts them)."""
    if not len(steps) == len(reference) == len(test):
        raise ValueError(f"steps, reference and test differ in length: {len(steps)}, {len(reference)}, {len(test)}")
    kept = [
        (step, float(r), float(t))
        for step, r, t in zip(steps, reference, test)
        if r is not None and t is not None and math.isfinite(r) and math.isfinite(t)
    ]
    left_out = len(steps) - len(kept)
    xs = [step for step, _, _ in kept]
    ref = [r for _, r, _ in kept]
    tst = [t for _, _, t in kept]
    errors = relative_errors_pct(ref, tst)
    scale = error_axis_scale(errors, limit_pct)
    if errors:
        summary = (
            f"relative error: mean {sum(errors) / len(errors):.3g}%, max {max(errors):.3g}% "
            f"over {len(errors)} steps (reference line {limit_pct:g}%)"
        )
    else:
        summary = "no step has both losses"
    if left_out:
        summary += f"\n{left_out} step(s) without both losses left out of the plot and the figures"
    width, height = 9.0, 7.0
    body = _new_figure(width, height, _wrap(title + "\n" + summary, _title_width(width, 13)))
    top, bottom = body.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    marker = "o" if len(xs) <= 30 else None
    top.plot(xs, ref, color=COLORS[0], linewidth=2.2, marker=marker, markersize=4, label=reference_label)
    top.plot(
        xs, tst, color=COLORS[1], linewidth=1.6, linestyle=(0, (5, 3)), marker=marker, markersize=3, label=test_label
    )
    top.set_ylabel("loss")
    top.legend(loc="upper right", frameon=False)
    top.grid(color="#e5e5e5", linewidth=0.8)

    limit_label = f"{limit_pct:g}% reference"
    positive = [(x, e) for x, e in zip(xs, errors) if e > 0]
    zeros = [x for x, e in zip(xs, errors) if e == 0]
    if scale == "log":
        floor = 10 ** math.floor(math.log10(min(e for _, e in positive)))
        bottom.set_yscale("log")
        bottom.set_ylim(floor / 2, limit_pct * 3)
        bottom.plot(
            [x for x, _ in positive],
            [e for _, e in positive],
            color="#444444",
            linewidth=1.0,
            marker="." if len(xs) <= 60 else None,
            label="relative error (log axis)",
        )
        if zeros:  # not representable on a log axis: marked on its bottom edge
            bottom.plot(
                zeros,
                [floor / 2] * len(zeros),
                linestyle="none",
                marker="^",
                color="#444444",
                markersize=5,
                clip_on=False,
                label=f"exactly 0 ({len(zeros)} step(s), drawn on the edge)",
            )
    else:
        from matplotlib.ticker import FuncFormatter

        bottom.plot(
            xs, errors, color="#444444", linewidth=1.0, marker="." if len(xs) <= 60 else None, label="relative error"
        )
        high = max([limit_pct] + [e for e in errors if math.isfinite(e)])
        bottom.set_ylim(0, high * 1.15)
        bottom.yaxis.set_major_formatter(FuncFormatter(_tick_text))
        if errors and not positive:
            bottom.annotate(
                "every step's relative error is exactly 0",
                (0.5, 0.35),
                xycoords="axes fraction",
                ha="center",
                fontsize=10,
                color="#444444",
            )
    bottom.axhline(limit_pct, color=LIMIT_COLOR, linewidth=1.5, label=limit_label)
    bottom.set_ylabel("relative error (%)")
    bottom.set_xlabel("step")
    bottom.grid(color="#e5e5e5", linewidth=0.8, which="major")
    # Above the panel's right end (the top panel has no tick labels there): never over the errors or the line.
    bottom.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=3, frameon=False, fontsize=9, borderaxespad=0.2)
    if not xs:
        top.annotate("no step has both losses", (0.5, 0.5), xycoords="axes fraction", ha="center")
    return _save(body, path)


def config_bars(
    labels: Sequence[str],
    series_values: Sequence[Sequence[float | None]],
    series_names: Sequence[str],
    title: str,
    ylabel: str,
    path: Path,
    value_format: str = "{:.3g}",
) -> Path:
    """One group per configuration (labels[i], e.g. "00_baseline" ... "10_full_ulysses") on one axis, with one bar
    per series: series_values[s][i] is series s's value (named series_names[s]: OFF/ON, max-rank/avg-rank) for
    labels[i]. The labels are slanted so that a dozen names do not overlap; a NaN or None value draws no bar and
    "n/a"."""
    if len(series_values) != len(series_names):
        raise ValueError(f"{len(series_values)} series of values for {len(series_names)} series names")
    for name, values in zip(series_names, series_values):
        if len(values) != len(labels):
            raise ValueError(f"series {name!r} has {len(values)} values for {len(labels)} labels")
    values = [[_number(v) for v in vs] for vs in series_values]
    count = max(1, len(values))
    width = max(7.0, 1.3 + len(labels) * (0.36 * count + 0.3))
    longest = max([len(label) for label in labels] + [1])
    height = 4.2 + 0.055 * longest  # room for the slanted labels
    title_text = _wrap(title, _title_width(width, 13))
    body = _new_figure(width, height + 0.25 * title_text.count("\n"), title_text)
    ax = body.subplots()
    centers = list(range(len(labels)))
    bar_width = 0.8 / count
    value_fontsize = 8 if count > 1 else 9
    handles = _draw_bars(ax, centers, values, bar_width, value_format, value_fontsize, 9)
    _value_axis(ax, [v for vs in values for v in vs])
    ax.set_xticks(centers, list(labels), rotation=35, ha="right", rotation_mode="anchor", fontsize=9)
    ax.set_xlim(-0.6, len(labels) - 0.4)
    ax.set_ylabel(ylabel)
    if handles and series_names:
        body.legend(handles, list(series_names), loc="outside upper center", ncol=len(series_names), frameon=False)
    return _save(body, path)
