"""Grouped bar charts as PNG, drawn with Pillow (a dependency already): no plotting library needed.

`bar_chart([(label, [v_series0, v_series1, ...]), ...], series=("OFF", "ON"), title=..., path=...)` draws one group
of bars per label, each bar's value above it, a legend, and under each group its label and optional note lines;
blue is the first series and orange the second, as in the reference report's figures. `shared_scale=False` (the
default) gives every group its own panel and y axis from 0, so a group whose values are 100x smaller than another's
still shows its OFF/ON ratio; `shared_scale=True` draws all groups on one axis.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))
BLACK, GRID, WHITE = (30, 30, 30), (220, 220, 220), (255, 255, 255)
# The default font has no arrows or dashes: labels and titles are drawn with ASCII stand-ins.
_ASCII = str.maketrans({"→": "->", "—": "-", "–": "-", "≥": ">=", "≤": "<=", "−": "-"})


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1: a scalable font
    except TypeError:
        return ImageFont.load_default()


def _text_size(draw: ImageDraw.ImageDraw, text: str, font: ImageFont.ImageFont) -> tuple[int, int]:
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    return right - left, bottom - top


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Round tick values from 0 to at least `top`."""
    if top <= 0 or not math.isfinite(top):
        return [0.0, 1.0]
    raw = top / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(math.ceil(top / step - 1e-9) + 1)]


def _tick_text(tick: float) -> str:
    return f"{tick:.4g}"


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
    group i's label."""
    font, small, big = _font(14), _font(12), _font(17)
    title = title.translate(_ASCII)
    bar_w, gap = 46, 6
    group_w = len(series) * bar_w + (len(series) - 1) * gap
    axis_w = 0 if shared_scale else 52  # room for each panel's own tick labels
    panel_w = group_w + axis_w + 34
    left, right, top, plot_h = (70 if shared_scale else 16), 24, 84, 360
    label_lines = []
    for index, (label, _) in enumerate(groups):
        lines = textwrap.wrap(label.translate(_ASCII), width=max(12, panel_w // 7), break_on_hyphens=False)
        if index < len(notes):
            lines += note_lines(notes[index])
        label_lines.append(lines or [""])
    bottom = 24 + 17 * max((len(lines) for lines in label_lines), default=1)
    width = max(640, left + right + len(groups) * panel_w)
    height = top + plot_h + bottom
    image = Image.new("RGB", (width, height), WHITE)
    draw = ImageDraw.Draw(image)

    draw.text((left, 14), title, fill=BLACK, font=big)
    legend_x = left
    for index, name in enumerate(series):
        draw.rectangle((legend_x, 46, legend_x + 14, 60), fill=COLORS[index % len(COLORS)])
        draw.text((legend_x + 20, 45), name, fill=BLACK, font=font)
        legend_x += 30 + _text_size(draw, name, font)[0]

    base_y = top + plot_h

    def axis(x_axis: float, x_end: float, values: Sequence[float]) -> float:
        """Gridlines and tick labels left of x_axis; returns pixels per unit."""
        finite = [v for v in values if math.isfinite(v)]
        ticks = nice_ticks(max(finite, default=1.0))
        scale = plot_h / ticks[-1]
        for tick in ticks:
            y = base_y - tick * scale
            draw.line((x_axis, y, x_end, y), fill=GRID)
            text = _tick_text(tick)
            draw.text((x_axis - 6 - _text_size(draw, text, small)[0], y - 7), text, fill=BLACK, font=small)
        draw.line((x_axis, top, x_axis, base_y), fill=BLACK)
        draw.line((x_axis, base_y, x_end, base_y), fill=BLACK)
        return scale

    if shared_scale:
        scale = axis(left, width - right, [v for _, vs in groups for v in vs])
    x = left
    for (_, vs), lines in zip(groups, label_lines):
        if not shared_scale:
            scale = axis(x + axis_w, x + panel_w - 8, vs)
        bars_x = x + axis_w + 14
        for index, value in enumerate(vs):
            x0 = bars_x + index * (bar_w + gap)
            if math.isfinite(value):
                draw.rectangle((x0, base_y - value * scale, x0 + bar_w, base_y), fill=COLORS[index % len(COLORS)])
                text = value_format.format(value)
                text_w = _text_size(draw, text, small)[0]
                draw.text((x0 + (bar_w - text_w) / 2, base_y - value * scale - 16), text, fill=BLACK, font=small)
        center = x + axis_w + (panel_w - axis_w) / 2
        for row, line in enumerate(lines):
            line_w = _text_size(draw, line, small)[0]
            draw.text((center - line_w / 2, base_y + 8 + 17 * row), line, fill=BLACK, font=small)
        x += panel_w

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="PNG")
    return path


def note_lines(note: str) -> list[str]:
    return note.translate(_ASCII).split("\n")
