"""Bar charts as inline SVG, drawn here on the server: no JavaScript, no CDN, works offline."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

WIDTH, HEIGHT = 720, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 36, 52
PLOT_WIDTH, PLOT_HEIGHT = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
BAR_FILL = "#417690"  # the admin's own blue
LABEL_EVERY_DAYS = 5


def axis_step(largest: int, target_ticks: int = 4) -> int:
    """The smallest of 1, 2, 5 x 10^k (k >= 0: counts are whole) giving at most `target_ticks` steps."""
    magnitude = 1
    while True:
        for factor in (1, 2, 5):
            step = factor * magnitude
            if step * target_ticks >= largest:
                return step
        magnitude *= 10


def compact_number(value: int) -> str:
    for size, suffix in ((1_000_000_000, "G"), (1_000_000, "M"), (1_000, "k")):
        if value >= size:
            return f"{value / size:.3g}{suffix}"
    return str(value)


@dataclass(frozen=True)
class Bar:
    key: str  # the bar's data attribute (data-day="2026-05-03", data-minute="10:41")
    label: str  # under the bar, where labels are shown
    value: int
    tooltip: str = ""  # the bar's <title> before its value; the key when empty


def daily_bar_chart(
    *, title: str, description: str, days: Sequence[tuple[date, int]], unit: str, chart_id: str
) -> SafeString:
    """One bar per day, oldest left; a day without usage is a bar of height 0 (still there, still titled)."""
    return bar_chart(
        title=title,
        description=description,
        bars=[Bar(day.isoformat(), f"{day:%m-%d}", value) for day, value in days],
        unit=unit,
        chart_id=chart_id,
        key_name="day",
        axis_label="day (UTC)",
        value_label=f"{unit} per day",
        label_every=LABEL_EVERY_DAYS,
    )


def bar_chart(
    *,
    title: str,
    description: str,
    bars: Sequence[Bar],
    unit: str,
    chart_id: str,
    key_name: str,
    axis_label: str,
    value_label: str,
    label_every: int = 1,
) -> SafeString:
    """One bar per entry of `bars`, left to right, on an axis from 0 to a round number; a bar of 0
    is still there (height 0, still titled). Labels under every `label_every`-th bar and the last."""
    largest = max((bar.value for bar in bars), default=0)
    step = axis_step(largest)
    axis_top = max(step, -(-largest // step) * step)  # at least one step, so never a division by 0
    slot = PLOT_WIDTH / max(1, len(bars))
    bar_width = slot * 0.7
    baseline = TOP + PLOT_HEIGHT

    def y_of(value: int) -> float:
        return baseline - PLOT_HEIGHT * value / axis_top

    title_id, desc_id = f"{chart_id}-title", f"{chart_id}-desc"
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" id="{escape(chart_id)}" class="usage-chart" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" width="100%" style="max-width: {WIDTH}px" role="img" '
        f'aria-labelledby="{title_id} {desc_id}" font-family="sans-serif" font-size="11">',
        f'<title id="{title_id}">{escape(title)}</title>',
        f'<desc id="{desc_id}">{escape(description)}</desc>',
        f'<text x="{WIDTH / 2}" y="18" text-anchor="middle" font-size="14" font-weight="bold" '
        f'fill="currentColor">{escape(title)}</text>',
    ]
    for tick in range(0, axis_top + 1, step):
        y = y_of(tick)
        parts.append(
            f'<line class="gridline" x1="{LEFT}" x2="{LEFT + PLOT_WIDTH}" y1="{y:.1f}" y2="{y:.1f}" '
            f'stroke="currentColor" stroke-opacity="0.15"/>'
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" fill="currentColor">'
            f"{compact_number(tick)}</text>"
        )
    for index, bar in enumerate(bars):
        x = LEFT + index * slot + (slot - bar_width) / 2
        y = y_of(bar.value)
        parts.append(
            f'<rect class="bar" data-{escape(key_name)}="{escape(bar.key)}" data-value="{bar.value}" '
            f'x="{x:.1f}" y="{y:.1f}" width="{bar_width:.1f}" height="{baseline - y:.1f}" fill="{BAR_FILL}">'
            f"<title>{escape(bar.tooltip or bar.key)}: {bar.value:,} {escape(unit)}</title></rect>"
        )
        tick_x = LEFT + (index + 0.5) * slot
        parts.append(
            f'<line x1="{tick_x:.1f}" x2="{tick_x:.1f}" y1="{baseline}" y2="{baseline + 4}" '
            f'stroke="currentColor"/>'
        )
        if index % label_every == 0 or index == len(bars) - 1:
            parts.append(
                f'<text class="{escape(key_name)}-label" x="{tick_x:.1f}" y="{baseline + 16}" '
                f'text-anchor="middle" fill="currentColor">{escape(bar.label)}</text>'
            )
    parts += [
        f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{baseline}" stroke="currentColor"/>',
        f'<line x1="{LEFT}" x2="{LEFT + PLOT_WIDTH}" y1="{baseline}" y2="{baseline}" stroke="currentColor"/>',
        f'<text x="{LEFT + PLOT_WIDTH / 2}" y="{HEIGHT - 8}" text-anchor="middle" fill="currentColor">'
        f"{escape(axis_label)}</text>",
        f'<text transform="translate(14 {TOP + PLOT_HEIGHT / 2}) rotate(-90)" text-anchor="middle" '
        f'fill="currentColor">{escape(value_label)}</text>',
        "</svg>",
    ]
    return mark_safe("".join(parts))  # every interpolated text above is escaped
