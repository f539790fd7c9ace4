"""The paper tour page (/tour): figures F6-F30 of docs/maths.md §3, in order, each reproduced live on
the shipped toy models (toy-0l, toy-1l, toy-2l) by app/tour/tour.py, with one sentence on what to look for
and a link into the full view. This module only turns each figure's data into charts and tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict

from app import charts, view_figures
from app.labels import unique_labels, visible
from app.params import TourParams
from app.routers.rendering import Page, PageCall
from app.tour.analysis import TOUR
from app.tour.figure_data import ClaimChart, TourData, TourFigure, TourView
from app.tour.paper_claims import PositivityCornerClaim
from app.tour.rotary_claims import InductionHeadsClaim, LogitByOrderClaim, ScoreTermsClaim


def figure_parts(fig: TourFigure) -> dict[str, Any]:
    """{charts: [figure dicts], tables: [(caption, entries, row label, col label)], trigrams: view | None}."""
    d = fig.data or TourData()
    out: dict[str, Any] = {"charts": [], "tables": [], "trigrams": None}
    add = out["charts"].append
    model = fig.model or ""
    for top, caption in ((d.direct, "direct path W_E W_U"), (d.ov, "OV circuit"), (d.qk, "QK circuit")):
        if top is not None:
            out["tables"].append(
                (f"{caption}{' of ' + top.head if top.head else ''}", top.entries, top.row_label, top.col_label)
            )
    out["trigrams"] = d.skip_trigrams
    if d.paths is not None:
        add(view_figures.paths_waterfall(d.paths))
    if d.positional is not None:
        pat = d.positional.pattern  # every position the sentence averages over
        labels = [str(i) for i in range(len(pat))]
        add(
            charts.heatmap(
                pat,
                labels,
                labels,
                title=f"positional pattern of {d.head}",
                x_title="key position",
                y_title="query position",
                signed=False,
                zmax=1.0,
                digits=3,
            )
        )
    if d.eigenvalues is not None:
        traces = [
            {
                "type": "scatter",
                "mode": "markers",
                "name": head,
                "x": [p[0] for p in pts],
                "y": [p[1] for p in pts],
                "hovertemplate": head + " λ = %{x:.3g} %{y:+.3g}i<extra></extra>",
            }
            for head, pts in d.eigenvalues.items()
        ]
        add(
            {
                "data": traces,
                "layout": {
                    "title": {"text": "OV eigenvalues of every head", "x": 0, "font": {"size": 13}},
                    "xaxis": {"title": {"text": "Re λ"}, "zeroline": True},
                    "yaxis": {"title": {"text": "Im λ"}, "zeroline": True},
                },
            }
        )
    if d.ov_copying is not None:
        heads = list(d.ov_copying)
        add(
            charts.bars(
                heads,
                [d.ov_copying[h] or 0.0 for h in heads],
                title="OV copying score Σλ/Σ|λ| per head",
                links=[f"/models/{model}/heads/{h}" for h in heads],
            )
        )
    if d.qk_paths is not None:
        qkv = d.qk_paths
        add(
            charts.heatmap(
                qkv.std,
                qkv.components,
                qkv.components,
                title=f"{qkv.head}: std of each (query, key) term",
                signed=False,
                x_title="key side",
                y_title="query side",
            )
        )
    compositions = d.compositions()
    shared = view_figures.shared_range([c.minus_baseline for c in compositions]) if len(compositions) > 1 else None
    for composition in compositions:  # Q, K and V on one colour range
        add(view_figures.composition_heatmap(composition, model, shared))
    if d.prompt is not None:
        pv = d.prompt
        for php in pv.heads:
            add(
                view_figures.attention_heatmap(
                    pv.tokens,
                    php.pattern,
                    f"{php.head} {'value-weighted ' if pv.weighted else ''}attention",
                    weighted=pv.weighted,
                    height=380,
                )
            )
    if d.path is not None:  # a virtual head: the chain's pattern, the product of its heads' patterns
        cv = d.path
        add(view_figures.attention_heatmap(cv.tokens, cv.pattern, f"pattern of {' → '.join(cv.heads)}", height=380))
    if d.next_token_effect is not None:  # F23 as in the paper: each position's effect on its own next token
        e = d.next_token_effect
        labels = unique_labels(  # a repeated pair would otherwise stack its bars on one category
            [f"{visible(a.text)} → {visible(b.text)}" for a, b in zip(e.tokens[:-1], e.tokens[1:], strict=True)]
        )
        add(
            charts.bars(
                labels,
                e.effects,
                title=f"{e.head}: effect on the logit of the actual next token, by position",
                y_title="logit",
            )
        )
    if d.detectors is not None:
        dv = d.detectors
        add(
            charts.lines(
                list(range(len(dv.loss.loss))),
                {"loss (nats)": dv.loss.loss},
                title="loss by position on BOS + r + r",
                x_title="position",
                y_title="loss",
            )
        )
        # the induction stripe: the pattern of the shown head with the highest induction score
        induction = {h.head: h.induction or 0.0 for h in dv.heads}
        for dhp in sorted(dv.patterns, key=lambda hp: -induction.get(hp.head, 0.0))[:1]:
            add(
                view_figures.attention_heatmap(
                    dv.tokens,
                    dhp.pattern,
                    f"{dhp.head} attention (induction {induction.get(dhp.head, 0.0):.2f})",
                    height=380,
                )
            )
    if d.pair is not None:
        pair = d.pair
        out["tables"].append(
            (
                f"K-composition {pair.source} → {pair.target}",
                pair.k_composition.entries,
                pair.k_composition.row_label,
                pair.k_composition.col_label,
            )
        )
    if d.points is not None:
        pts = d.points
        corner = PositivityCornerClaim.model_validate(d.claim) if d.claim else None  # F26's measured sentence
        add(
            charts.scatter(
                [p.ov_copying or 0.0 for p in pts],
                [p.k_composition_positivity for p in pts],
                [p.head for p in pts],
                title=f"OV copying vs K-composition positivity (previous-token head {d.previous_token_head})",
                x_title="OV copying score",
                y_title="K-composition positivity",
                links=[f"/models/{model}/heads/{p.head}" for p in pts],
                named=[p[0] for p in corner.points] if corner else [],  # the heads the caption names
            )
        )
    if d.term_importance is not None:
        m = d.term_importance.marginal_by_order
        add(
            charts.bars(
                [f"order {i + 1}" for i in range(len(m))],
                m,
                title="loss reduction added by each order",
                y_title="Δ loss",
            )
        )
    if d.first_order_by_layer is not None:
        v2 = d.first_order_by_layer
        add(
            charts.bars(
                [f"layer {i}" for i in range(len(v2))], v2, title="first-order terms by layer", y_title="Δ loss"
            )
        )
    if d.claim_chart is not None and d.claim is not None:
        CLAIM_CHARTS[d.claim_chart](d.claim, add)
    return out


def _r1(claim: dict[str, Any], add: Any) -> None:
    """The induction and previous-token heads' scores, and C_K(δ) of each induction head's strongest source."""
    v = InductionHeadsClaim.model_validate(claim)
    heads = [h for h, _ in v.induction] + [h for h, _ in v.previous_token]
    scores = [s for _, s in v.induction] + [s for _, s in v.previous_token]
    kinds = ["induction"] * len(v.induction) + ["previous token"] * len(v.previous_token)
    add(
        charts.bars(
            [f"{h} ({k})" for h, k in zip(heads, kinds, strict=True)],
            scores,
            title="heads above the threshold: induction and previous-token scores",
            y_title="detector score",
        )
    )
    if v.k_sources:
        series: dict[str, list[float | None]] = {f"{s.source} → {s.target}": list(s.profile) for s in v.k_sources}
        n = len(next(iter(series.values()), []))
        series["random baseline"] = [v.baseline] * n
        add(
            charts.lines(
                list(range(n)),
                series,
                title="K-composition C_K(δ) of each induction head with its strongest previous-token source",
                x_title="δ = query position − key position",
                y_title="K-composition",
            )
        )


def _r2(claim: dict[str, Any], add: Any) -> None:
    v = LogitByOrderClaim.model_validate(claim)
    add(
        charts.waterfall(
            ["order 0", "order 1 (one head)", "longer paths"],
            [v.order0, v.order1, v.remainder],
            v.value,
            total_label="model logit",
            title=f"the logit at position {v.position} by path order (sums to the model's {v.value:.2f})",
        )
    )


def _r3(claim: dict[str, Any], add: Any) -> None:
    v = ScoreTermsClaim.model_validate(claim)
    add(
        charts.bars(
            [f"({q} query, {k} key)" for q, k, _ in v.top_terms],
            [t for _, _, t in v.top_terms],
            title=f"{v.head}: the largest terms of its score {v.score:.2f} (query {v.query} → key {v.key})",
            y_title="score term",
        )
    )


# the chart a chapter's figure draws from its sentence's values (TourData.claim_chart: the SmolLM2 chapter's R1-R3)
CLAIM_CHARTS: dict[ClaimChart, Callable[[dict[str, Any], Callable[[dict[str, Any]], None]], None]] = {
    "induction_heads": _r1,
    "logit_by_order": _r2,
    "score_terms": _r3,
}


class TourContext(TypedDict):
    """templates/tour.html: the chapter's figures, each with its parts drawn (figure_parts; None: unavailable)."""

    view: TourView
    parts: list[tuple[TourFigure, dict[str, Any] | None]]
    params: TourParams


async def tour_context(call: PageCall[TourParams]) -> TourContext:
    view = await call.run(TOUR, call.params)
    parts = [(fig, figure_parts(fig) if fig.available and fig.data else None) for fig in view.figures]
    call.title = {"paper": "Paper tour", "smollm2": "Tour: SmolLM2-135M", "gemma3": "Tour: Gemma-3 270M"}[
        call.params.chapter
    ]
    return {"view": view, "parts": parts, "params": call.params}


PAGES: list[Page[Any]] = [Page(TOUR, "tour.html", tour_context)]
