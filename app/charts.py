"""Views -> plotly figure dicts (plain JSON: {data, layout, links}); static/charts.js draws them.

Charts are data inside the HTML fragment (no page fetches its own JSON). Each function takes a view
(pydantic, from app/views) or plain lists taken from one, never tensors. Conventions (docs/design.md §5):
heads are labelled L{layer}H{head}; signed values use the diverging RdBu scale centred on 0 (red negative,
blue positive); `links` maps a trace index to the URL opened on click (a list by point, or rows x cols for a
heatmap), which is how a heatmap cell opens its head or pair.

These are the primitives (heatmap, bars, waterfall, scatters, lines); how tokens and terms are written on them is
app/labels.py, and the figures of whole views (an attention pattern, a path expansion, a composition matrix) are
app/view_figures.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from app.figure_output import MAX_HEIGHT
from app.labels import shown_labels

Figure = dict[str, Any]

# ColorBrewer RdBu, red negative -> white 0 -> blue positive, centred with zmid=0 (plotly's built-in "RdBu"
# runs the other way, blue low); sequential white -> blue for values in [0, max].
SIGNED_SCALE = [[0.0, "#b2182b"], [0.25, "#ef8a62"], [0.5, "#f7f7f7"], [0.75, "#67a9cf"], [1.0, "#2166ac"]]
UNSIGNED_SCALE = [[0.0, "#ffffff"], [0.15, "#deebf7"], [0.5, "#6baed6"], [1.0, "#08306b"]]
# Categorical series (no sign meaning, so neither the red nor the blue of signed values)
PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#b279a2", "#9d755d", "#72b7b2"]
POS_COLOR = "#2166ac"
NEG_COLOR = "#b2182b"
GREY = "#8a94a1"
# A horizontal legend above the plot, right-aligned: below it, it would cover the x-axis title.
LEGEND_TOP = {"orientation": "h", "x": 1, "xanchor": "right", "y": 1.0, "yanchor": "bottom"}


def rounded(z: Sequence[Sequence[float | None]], digits: int) -> list[list[float | None]]:
    """Matrix values rounded for display (the JSON twin keeps full precision): keeps fragments small."""
    return [[None if v is None else round(v, digits) for v in row] for row in z]


def _axis(title: str | None = None, **extra: Any) -> dict[str, Any]:
    axis: dict[str, Any] = {"automargin": True, "zeroline": False}
    if title:
        axis["title"] = {"text": title}
    axis.update(extra)
    return axis


def heatmap(
    z: Sequence[Sequence[float | None]],
    x: Sequence[str],
    y: Sequence[str],
    *,
    title: str = "",
    x_title: str | None = None,
    y_title: str | None = None,
    signed: bool = True,
    zmax: float | None = None,
    hover: str | None = None,
    customdata: Sequence[Sequence[Any]] | None = None,
    links: Sequence[Sequence[str | None]] | None = None,
    colorbar: str = "",
    reversed_y: bool = True,
    text_in_cells: bool = False,
    cell_format: str = "%{z:.2f}",
    height: int | None = None,
    digits: int = 4,
) -> Figure:
    """A heatmap of rows y by columns x; signed values on RdBu centred on 0 with a symmetric range."""
    z = rounded(z, digits)
    trace: dict[str, Any] = {
        "type": "heatmap",
        "z": z,
        "x": list(x),
        "y": list(y),
        "colorbar": {"title": {"text": colorbar}, "thickness": 12},
    }
    values = [v for row in z for v in row if v is not None]
    if signed:
        bound = zmax if zmax is not None else max((abs(v) for v in values), default=1.0) or 1.0
        trace.update(colorscale=SIGNED_SCALE, zmid=0, zmin=-bound, zmax=bound)
    else:
        trace.update(
            colorscale=UNSIGNED_SCALE, zmin=0, zmax=zmax if zmax is not None else max(values, default=1.0) or 1.0
        )
    if customdata is not None:
        trace["customdata"] = customdata
    trace["hovertemplate"] = (hover or "%{y} · %{x}<br>%{z:.4f}") + "<extra></extra>"
    if text_in_cells:
        trace.update(texttemplate=cell_format, textfont={"size": 11 if len(y) <= 16 and len(x) <= 6 else 9})
    # numbered axes (positions) of many categories: a tick every few, so the numbers do not run together;
    # named axes (tokens, heads) label every category while there is room (EVERY_LABEL_MAX, smaller type)
    x_step, y_step = _ticks(x, EVERY_COLUMN_MAX), _ticks(y, EVERY_LABEL_MAX)
    layout: dict[str, Any] = {
        "title": {"text": title, "x": 0, "font": {"size": 13}},
        "xaxis": _axis(
            x_title,
            type="category",
            side="bottom",
            tickangle=(-90 if len(x) > 24 else -45) if len(x) > 6 and max(map(len, x), default=0) > 2 else 0,
            **x_step,
        ),
        "yaxis": _axis(y_title, type="category", autorange="reversed" if reversed_y else True, **y_step),
    }
    if height:
        layout["height"] = (
            label_room(len(y), height) if y_step.get("dtick") == 1 else height
        )  # room for every row label
    fig: Figure = {"data": [trace], "layout": layout}
    if links is not None:
        fig["links"] = {"0": links}
    return fig


MOST_HEAD_BARS = 24  # a bar chart of one score per head draws at most this many heads (its table lists every head)
EVERY_LABEL_MAX = 64  # up to this many named rows, every one is labelled (the figure grows to fit them)
EVERY_COLUMN_MAX = (
    24  # columns: a half-width chart has room for about this many vertical labels; beyond, plotly thins them
)


def _ticks(labels: Sequence[str], every_max: int) -> dict[str, Any]:
    if len(labels) > 24 and all(label.isdigit() for label in labels):
        return {"dtick": -(-len(labels) // 16)}
    if len(labels) <= every_max:
        return {"dtick": 1, "tickfont": {"size": 12 if len(labels) <= 24 else 10}}
    return {}


def cells_fit(n_rows: int, n_cols: int, height: int = MAX_HEIGHT, width: int = 560) -> bool:
    """Whether a value like '0.12' (about 28 x 12 px at 9-11 px type) fits in every cell of an n_rows x n_cols
    heatmap drawn at most `height` px tall (170 px of margins and title) and `width` px wide (a half-width chart)."""
    return (height - 170) / max(n_rows, 1) >= 14 and (width - 120) / max(n_cols, 1) >= 30


def label_room(n: int, height: int) -> int:
    """A heatmap height with room for one label per row (about 13 px each at 10 px type, plus the margins)."""
    return max(height, 13 * n + 170) if n <= EVERY_LABEL_MAX else height


def bars(
    labels: Sequence[str],
    values: Sequence[float],
    *,
    title: str = "",
    x_title: str | None = None,
    y_title: str | None = None,
    links: Sequence[str | None] | None = None,
    horizontal: bool = False,
    hover: str | None = None,
    height: int | None = None,
    customdata: Sequence[Any] | None = None,
) -> Figure:
    """Signed bars: blue positive, red negative."""
    colors = [POS_COLOR if v >= 0 else NEG_COLOR for v in values]
    trace: dict[str, Any] = {"type": "bar", "marker": {"color": colors}}
    if customdata is not None:
        trace["customdata"] = list(customdata)
    if horizontal:
        trace.update(x=list(values), y=list(labels), orientation="h")
        trace["hovertemplate"] = (hover or "%{y}: %{x:.4f}") + "<extra></extra>"
    else:
        trace.update(x=list(labels), y=list(values))
        trace["hovertemplate"] = (hover or "%{x}: %{y:.4f}") + "<extra></extra>"
    layout: dict[str, Any] = {
        "title": {"text": title, "x": 0, "font": {"size": 13}},
        "xaxis": _axis(x_title, type="category" if not horizontal else "linear"),
        "yaxis": _axis(
            y_title, type="category" if horizontal else "linear", autorange="reversed" if horizontal else True
        ),
        "showlegend": False,
    }
    if height:
        layout["height"] = height
    fig: Figure = {"data": [trace], "layout": layout}
    if links is not None:
        fig["links"] = {"0": list(links)}
    return fig


def waterfall(
    labels: Sequence[str],
    values: Sequence[float],
    total: float,
    *,
    title: str = "",
    total_label: str = "total",
    y_title: str = "logit",
    links: Sequence[str | None] | None = None,
) -> Figure:
    """A waterfall drawn with bars on a running `base` (the cartesian bundle has no waterfall trace): each
    term starts where the previous one ended, and the last bar is the model's own value, so the chart visibly
    sums to it."""
    bases, running = [], 0.0
    for v in values:
        bases.append(running)
        running += v
    x = list(labels) + [total_label]
    colors = [POS_COLOR if v >= 0 else NEG_COLOR for v in values] + ["#444"]
    trace = {
        "type": "bar",
        "x": x,
        "y": list(values) + [total],
        "base": bases + [0.0],
        "marker": {"color": colors},
        "customdata": [[b, b + v] for b, v in zip(bases, values, strict=True)] + [[0.0, total]],
        "hovertemplate": "%{x}<br>term %{y:+.4f}<br>running sum %{customdata[1]:.4f}<extra></extra>",
    }
    fig: Figure = {
        "data": [trace],
        "layout": {
            "title": {"text": title, "x": 0, "font": {"size": 13}},
            "xaxis": _axis(None, type="category", tickangle=-45 if len(x) > 10 else 0),
            "yaxis": _axis(y_title, zeroline=True),
            "shapes": [
                {
                    "type": "line",
                    "xref": "paper",
                    "x0": 0,
                    "x1": 1,
                    "y0": total,
                    "y1": total,
                    "line": {"color": "#444", "dash": "dot", "width": 1},
                }
            ],
            "showlegend": False,
        },
    }
    if links is not None:
        fig["links"] = {"0": list(links) + [None]}
    return fig


def complex_scatter(
    points: Sequence[tuple[float, float]], *, title: str = "", null: Sequence[tuple[float, float]] | None = None
) -> Figure:
    """Eigenvalues in the complex plane (paper Fig. "Detecting copying"): blue Re>0, red Re<0; optional
    random-init null in grey."""
    data: list[dict[str, Any]] = []
    if null:
        data.append(
            {
                "type": "scatter",
                "mode": "markers",
                "name": "random init",
                "x": [p[0] for p in null],
                "y": [p[1] for p in null],
                "marker": {"color": "#c9ced6", "size": 6},
                "hovertemplate": "null %{x:.3g} %{y:+.3g}i<extra></extra>",
            }
        )
    data.append(
        {
            "type": "scatter",
            "mode": "markers",
            "name": "eigenvalues",
            "x": [p[0] for p in points],
            "y": [p[1] for p in points],
            "marker": {
                "color": [POS_COLOR if p[0] >= 0 else NEG_COLOR for p in points],
                "size": 8,
                "line": {"width": 0.5, "color": "#fff"},
            },
            "hovertemplate": "λ = %{x:.4g} %{y:+.4g}i<extra></extra>",
        }
    )
    return {
        "data": data,
        "layout": {
            "title": {"text": title, "x": 0, "font": {"size": 13}},
            "xaxis": _axis("Re λ", zeroline=True, zerolinecolor="#999", rangemode="tozero"),  # the origin always shows
            "yaxis": _axis("Im λ", zeroline=True, zerolinecolor="#999", scaleanchor="x"),
            "showlegend": bool(null),
        },
    }


def scatter(
    x: Sequence[float],
    y: Sequence[float],
    labels: Sequence[str],
    *,
    title: str = "",
    x_title: str = "",
    y_title: str = "",
    links: Sequence[str | None] | None = None,
    highlight: Sequence[bool] | None = None,
    named: Sequence[str] = (),
) -> Figure:
    """Points (heads), e.g. the paper's OV-copying vs K-composition positivity scatter. The `named` points (the
    heads that matter: induction and previous-token heads, the head a caption is about) are always labelled; then
    the outlying points whose labels cannot collide (`shown_labels`); every point names itself on hover."""
    colors = [NEG_COLOR if h else POS_COLOR for h in highlight] if highlight else POS_COLOR
    fig: Figure = {
        "data": [
            {
                "type": "scatter",
                "mode": "markers+text",
                "x": list(x),
                "y": list(y),
                "text": shown_labels(x, y, labels, named=named),
                "customdata": list(labels),
                "textposition": "top center",
                "textfont": {"size": 10, "color": GREY},
                "marker": {"size": 10, "color": colors, "line": {"width": 0.5, "color": "#fff"}},
                "hovertemplate": "%{customdata}<br>x %{x:.3f}<br>y %{y:.3f}<extra></extra>",
            }
        ],
        "layout": {
            "title": {"text": title, "x": 0, "font": {"size": 13}},
            "xaxis": _axis(x_title, zeroline=True, zerolinecolor="#bbb"),
            "yaxis": _axis(y_title, zeroline=True, zerolinecolor="#bbb"),
            "showlegend": False,
        },
    }
    if links is not None:
        fig["links"] = {"0": list(links)}
    return fig


def grouped_bars(
    categories: Sequence[str],
    series: Mapping[str, Sequence[float]],
    *,
    title: str = "",
    y_title: str = "",
    x_title: str | None = None,
) -> Figure:
    """Several named series over the same categories (e.g. detector scores per head)."""
    data = [
        {
            "type": "bar",
            "name": name,
            "x": list(categories),
            "y": list(vals),
            "marker": {"color": PALETTE[i % len(PALETTE)]},
            "hovertemplate": f"{name}<br>%{{x}}: %{{y:.4f}}<extra></extra>",
        }
        for i, (name, vals) in enumerate(series.items())
    ]
    return {
        "data": data,
        "layout": {
            "title": {"text": title, "x": 0, "font": {"size": 13}},
            "barmode": "group",
            "xaxis": _axis(x_title, type="category"),
            "yaxis": _axis(y_title),
            "legend": LEGEND_TOP if x_title else {"orientation": "h", "y": -0.25},
        },
    }


def lines(
    x: Sequence[float],
    series: Mapping[str, Sequence[float | None]],
    *,
    title: str = "",
    x_title: str = "",
    y_title: str = "",
    vlines: Sequence[float] = (),
) -> Figure:
    """Line chart of named series (e.g. per-position loss), with optional vertical markers."""
    data = [
        {
            "type": "scatter",
            "mode": "lines",
            "name": name,
            "x": list(x),
            "y": list(vals),
            "line": {"color": PALETTE[i % len(PALETTE)], "width": 1.5},
        }
        for i, (name, vals) in enumerate(series.items())
    ]
    shapes = [
        {
            "type": "line",
            "x0": v,
            "x1": v,
            "yref": "paper",
            "y0": 0,
            "y1": 1,
            "line": {"color": "#999", "dash": "dot", "width": 1},
        }
        for v in vlines
    ]
    return {
        "data": data,
        "layout": {
            "title": {"text": title, "x": 0, "font": {"size": 13}},
            "xaxis": _axis(x_title),
            "yaxis": _axis(y_title),
            "shapes": shapes,
            "legend": LEGEND_TOP if x_title else {"orientation": "h", "y": -0.2},
        },
    }
