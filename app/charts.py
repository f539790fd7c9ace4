"""Views -> plotly figure dicts (plain JSON: {data, layout, links}); static/charts.js draws them.

Charts are data inside the HTML fragment (no page fetches its own JSON). Each function takes a view
(pydantic, from app/views) or plain lists taken from one, never tensors. Conventions (docs/design.md §5):
heads are labelled L{layer}H{head}; signed values use the diverging RdBu scale centred on 0 (red negative,
blue positive); `links` maps a trace index to the URL opened on click (a list by point, or rows x cols for a
heatmap), which is how a heatmap cell opens its head or pair.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from app.figure_output import MAX_HEIGHT

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


# Whitespace and control characters drawn visibly: · space, ⏎ newline, ⇥ tab, and an ASCII escape (\r, \x0c,
# \x7f, \x85, \xa0) for every other control character and the no-break space (the Unicode control pictures
# are missing from common monospace fonts and would show as empty boxes).
VISIBLE = {
    " ": "·",
    "\n": "⏎",
    "\t": "⇥",
    "\r": "\\r",
    **{chr(c): f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA1)] if chr(c) not in "\n\t\r"},
}
VISIBLE_TABLE = str.maketrans(VISIBLE)


def visible(text: str | None) -> str:
    """A token as the dashboard shows it (axes, tables): whitespace and control characters visible, ∅ if empty."""
    return text.translate(VISIBLE_TABLE) if text else "∅"


def unique_labels(labels: Sequence[str]) -> list[str]:
    """Plotly merges equal category labels; make repeated tokens distinct by their position."""
    labels = list(labels)
    return [f"{lab} [{i}]" if labels.count(lab) > 1 else lab for i, lab in enumerate(labels)]


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


def shown_labels(
    x: Sequence[float], y: Sequence[float], labels: Sequence[str], most: int = 10, named: Sequence[str] = ()
) -> list[str]:
    """The labels drawn on a scatter: every `named` label, then the points farthest from the centre, each kept
    only when no kept label's point lies within a label's box of it (in fractions of the axis ranges), at most
    `most` in all (the named ones always). Named points too close to label apart share one label ("L1H0, L1H2")
    at the first of them."""
    if not labels:
        return []
    span_x = (max(x) - min(x)) or 1.0
    span_y = (max(y) - min(y)) or 1.0

    def collides(i: int, j: int, text: str) -> bool:
        box_x = 0.12 * max(1, len(text)) / 4  # a label is about 12 % of the width per four characters
        return abs(x[i] - x[j]) / span_x <= box_x and abs(y[i] - y[j]) / span_y <= 0.09

    text: dict[int, str] = {}  # point -> its drawn label
    for i in (i for i, lab in enumerate(labels) if lab in set(named)):
        near = next((j for j in text if collides(i, j, max(labels[i], text[j], key=len))), None)
        if near is None:
            text[i] = labels[i]
        else:
            text[near] += ", " + labels[i]
    cx, cy = sum(x) / len(x), sum(y) / len(y)
    order = sorted(range(len(labels)), key=lambda i: -(((x[i] - cx) / span_x) ** 2 + ((y[i] - cy) / span_y) ** 2))
    shown = set(text) | {i for i, lab in enumerate(labels) if lab in set(named)}
    for i in order:
        if len(shown) >= most:
            break
        if i not in shown and not any(collides(i, j, max(labels[i], text[j], key=len)) for j in text):
            text[i] = labels[i]
            shown.add(i)
    return [text.get(i, "") for i in range(len(labels))]


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


# -- figures of whole views (shared by the pages and the paper tour) -------------------------------------
def token_labels(tokens: Sequence[Any]) -> list[str]:
    """Axis labels of a prompt's tokens: visible whitespace, made unique by position."""
    return unique_labels([visible(t.text) for t in tokens])


def term_label(path: Sequence[str], kind: str, n_terms: int | None = None) -> str:
    """A path term's name: 'direct', 'L1H4', 'L0H1→L1H4', 'mlp:L0→L1H4', 'remainder', 'other (12)'."""
    if kind == "other":
        return f"other ({n_terms} terms)" if n_terms else "other"
    if kind == "remainder":
        return "remainder (higher orders)"
    return "→".join(path) if path else "direct"


def attention_heatmap(
    tokens: Sequence[Any], pattern: Sequence[Sequence[float]], title: str, *, weighted: bool = False, height: int = 420
) -> Figure:
    labels = token_labels(tokens)
    zmax = None if weighted else 1.0
    return heatmap(
        pattern,
        labels,
        labels,
        title=title,
        x_title="key (source)",
        y_title="query (destination)",
        signed=False,
        zmax=zmax,
        hover="query %{y}<br>key %{x}<br>%{z:.3f}",
        colorbar="A·‖v‖" if weighted else "attention",
        height=label_room(len(labels), height),
        digits=3,
    )


def paths_waterfall(view: Any, links: Sequence[str | None] | None = None) -> Figure:
    """The listed path terms (+ 'other' and the remainder) as a waterfall ending at the model's value."""
    labels = [term_label(t.path, t.kind, t.n_terms) for t in view.terms]
    what = f"logit({visible(view.target_token.text)})" + (
        f" − logit({visible(view.contrast_token.text)})" if view.contrast_token else ""
    )
    return waterfall(
        labels,
        [t.value for t in view.terms],
        view.value,
        total_label="model value",
        title=f"{what} at position {view.position}: Σ terms = {view.total:.4f}, model = {view.value:.4f}",
        y_title="logit" if view.contrast is None else "logit difference",
        links=links,
    )


def paths_by_source(view: Any) -> Figure | None:
    """Each listed term split over the source positions it reads from (rows sum to the term's value)."""
    rows = [t for t in view.terms if t.by_source is not None]
    if not rows:
        return None
    z = [t.by_source for t in rows]
    return heatmap(
        z,
        token_labels(view.prompt_tokens),
        [term_label(t.path, t.kind) for t in rows],
        title="terms by source token",
        x_title="source token",
        y_title="path",
        signed=True,
        hover="%{y} from %{x}<br>%{z:+.4f}",
        colorbar="logit",
        height=max(260, 22 * len(rows) + 140),
    )


def composition_heatmap(view: Any, model_id: str, zmax: float | None = None) -> Figure:
    """score − baseline of every (earlier, later) pair on RdBu; raw score on hover; a click opens the pair.
    `zmax`: the colour range ±zmax, shared by the Q, K and V views of a model so their colours compare."""
    custom = [[[raw] for raw in row] for row in view.scores]
    links = [
        [
            f"/models/{model_id}/composition/{s}/{t}" if view.scores[i][j] is not None else None
            for j, t in enumerate(view.targets)
        ]
        for i, s in enumerate(view.sources)
    ]
    return heatmap(
        view.minus_baseline,
        view.targets,
        view.sources,
        title=f"{view.kind}-composition − baseline {view.baseline:.3f} (click a pair)"
        + (f" · colour scale ±{zmax:.3f}, shared by Q, K and V" if zmax else ""),
        x_title="later head (reads)",
        y_title="earlier head (writes)",
        signed=True,
        customdata=custom,
        zmax=zmax,
        hover="%{y} → %{x}<br>" + view.kind + "-composition %{customdata[0]:.4f}<br>minus baseline %{z:+.4f}",
        links=links,
        colorbar="score − baseline",
        height=label_room(len(view.sources), max(280, 26 * len(view.sources) + 140)),
    )


def shared_range(matrices: Sequence[Sequence[Sequence[float | None]]]) -> float | None:
    """One symmetric colour range for several signed heatmaps (e.g. Q, K and V composition): the largest |value|."""
    return max((abs(v) for z in matrices for row in z for v in row if v is not None), default=0.0) or None


def complex_points(values: Sequence[Any]) -> list[tuple[float, float]]:
    return [(c.re, c.im) for c in values]


def attention_text(
    tokens: Sequence[Any], patterns: Mapping[str, Sequence[Sequence[float]]], paths: Any = None
) -> dict[str, Any]:
    """The data of the attention text view (static/reading.js): the prompt's tokens as text, each named pattern
    (a head's or a chain's; rows: destination, columns: source) and, given a path expansion (PathsView), each
    listed term's contribution per source token, with the position and logit it expands."""
    terms = paths.terms if paths is not None else ()
    return {
        "position": paths.position if paths is not None else None,
        "logit": f"logit({paths.target_token.text!r})"
        + (f" − logit({paths.contrast_token.text!r})" if paths.contrast_token else "")
        if paths is not None
        else None,
        "tokens": [{"id": t.id, "text": t.text} for t in tokens],
        "heads": {name: rounded(pattern, 4) for name, pattern in patterns.items()},
        "terms": [
            {"label": term_label(t.path, t.kind), "values": [round(v, 5) for v in t.by_source]}
            for t in terms
            if t.by_source is not None
        ],
    }
