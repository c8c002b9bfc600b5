"""The server-drawn SVG charts: one bar per day, scaled to the data, valid XML even when empty."""

from __future__ import annotations

from datetime import date, timedelta
from xml.etree import ElementTree

import pytest

from embeddings.admin_charts import (
    PLOT_HEIGHT,
    TOP,
    Bar,
    axis_step,
    bar_chart,
    compact_number,
    daily_bar_chart,
)

SVG = "{http://www.w3.org/2000/svg}"


def thirty_days(values: dict[int, int] | None = None) -> list[tuple[date, int]]:
    first = date(2026, 5, 3)
    return [(first + timedelta(days=offset), (values or {}).get(offset, 0)) for offset in range(30)]


def render(days, **overrides) -> ElementTree.Element:
    options = {"title": "Tokens", "description": "Daily tokens", "unit": "tokens", "chart_id": "c"}
    return ElementTree.fromstring(str(daily_bar_chart(days=days, **{**options, **overrides})))


def bars(svg: ElementTree.Element) -> list[ElementTree.Element]:
    return [rect for rect in svg.iter(f"{SVG}rect") if rect.get("class") == "bar"]


def test_one_bar_per_day_oldest_first_with_idle_days_as_zero_bars():
    svg = render(thirty_days({0: 10, 29: 40}))

    found = bars(svg)
    assert len(found) == 30
    assert [bar.get("data-day") for bar in found][:2] == ["2026-05-03", "2026-05-04"]
    assert found[-1].get("data-day") == "2026-06-01"
    assert float(found[1].get("height")) == 0.0 and found[1].get("data-value") == "0"
    assert found[1].find(f"{SVG}title").text == "2026-05-04: 0 tokens"
    xs = [float(bar.get("x")) for bar in found]
    assert xs == sorted(xs)


def test_bar_heights_are_proportional_to_values():
    svg = render(thirty_days({3: 100, 4: 50, 5: 25}))

    heights = {bar.get("data-day"): float(bar.get("height")) for bar in bars(svg)}
    tall, half, quarter = heights["2026-05-06"], heights["2026-05-07"], heights["2026-05-08"]
    assert tall == pytest.approx(PLOT_HEIGHT)  # 100 is a whole number of axis steps: the top
    assert half == pytest.approx(tall / 2, abs=0.1)
    assert quarter == pytest.approx(tall / 4, abs=0.1)
    # Every bar stands on the same baseline.
    assert {round(float(bar.get("y")) + float(bar.get("height")), 1) for bar in bars(svg)} == {
        TOP + PLOT_HEIGHT
    }


def test_the_axis_goes_past_the_largest_value_to_a_round_number():
    svg = render(thirty_days({0: 1234}))
    labels = [text.text for text in svg.iter(f"{SVG}text")]
    assert "1.5k" in labels and "0" in labels  # steps of 500 up to 1,500
    (bar,) = [bar for bar in bars(svg) if bar.get("data-value") == "1234"]
    assert float(bar.get("height")) == pytest.approx(PLOT_HEIGHT * 1234 / 1500, abs=0.1)


def test_empty_data_renders_an_empty_chart():
    svg = render(thirty_days())
    assert len(bars(svg)) == 30
    assert all(float(bar.get("height")) == 0 for bar in bars(svg))

    no_days = render([])
    assert bars(no_days) == []
    assert no_days.find(f"{SVG}title").text == "Tokens"


def test_the_chart_is_accessible_and_escapes_text():
    svg = render(thirty_days(), title='Tokens <&> "Alpha"', description="for 'A'", chart_id="tokens")

    assert svg.get("role") == "img"
    assert svg.get("aria-labelledby") == "tokens-title tokens-desc"
    assert svg.find(f"{SVG}title").text == 'Tokens <&> "Alpha"'
    assert svg.find(f"{SVG}desc").text == "for 'A'"
    day_labels = [text.text for text in svg.iter(f"{SVG}text") if text.get("class") == "day-label"]
    assert day_labels == ["05-03", "05-08", "05-13", "05-18", "05-23", "05-28", "06-01"]


def test_any_bars_keyed_labelled_and_titled_as_given():
    """As the operations overview draws its minutes: keyed by minute, labelled every other bar."""
    minutes = [Bar(f"10:{minute:02d}", f"10:{minute:02d}", minute % 3) for minute in range(40, 50)]
    minutes.append(Bar("10:50", "now", 6, tooltip="10:50 UTC (so far)"))
    svg = ElementTree.fromstring(
        str(
            bar_chart(
                title="Requests <per> minute", description="d", bars=minutes, unit="requests",
                chart_id="requests", key_name="minute", axis_label="minute (UTC)", value_label="requests",
                label_every=2,
            )
        )
    )  # fmt: skip
    found = bars(svg)
    assert [bar.get("data-minute") for bar in found] == [f"10:{minute}" for minute in range(40, 51)]
    assert float(found[-1].get("height")) == pytest.approx(PLOT_HEIGHT)  # 6: a whole number of steps
    assert float(found[1].get("height")) == pytest.approx(PLOT_HEIGHT * 2 / 6, abs=0.1)  # 10:41: 2
    assert found[-1].find(f"{SVG}title").text == "10:50 UTC (so far): 6 requests"
    labels = [text.text for text in svg.iter(f"{SVG}text") if text.get("class") == "minute-label"]
    assert labels == ["10:40", "10:42", "10:44", "10:46", "10:48", "now"]
    assert svg.find(f"{SVG}title").text == "Requests <per> minute"


@pytest.mark.parametrize(
    ("largest", "step"), [(0, 1), (1, 1), (4, 1), (5, 2), (8, 2), (9, 5), (20, 5), (21, 10), (1234, 500)]
)
def test_axis_step(largest, step):
    assert axis_step(largest) == step


def test_compact_number():
    assert [compact_number(n) for n in (0, 999, 1000, 1500, 2_500_000, 3_000_000_000)] == [
        "0",
        "999",
        "1k",
        "1.5k",
        "2.5M",
        "3G",
    ]
