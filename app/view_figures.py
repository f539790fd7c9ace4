"""Figures of whole views, shared by the pages and the paper tour: an attention pattern, a path expansion as a
waterfall and by source token, a composition matrix, the attention text view's data. Built from the primitives
in app/charts.py (whose conventions they follow) and the labels of app/labels.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from app.charts import Figure, heatmap, label_room, rounded, waterfall
from app.labels import term_label, token_labels, visible


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
