"""Figures on their way to a page: token strings escaped for plotly's HTML subset, heights capped, and the
layer-block heat maps and head filter that make 30-layer models readable."""

from __future__ import annotations

import html
from types import SimpleNamespace

import pytest

from app import block_heatmaps, charts, view_figures
from app.figure_output import MAX_HEIGHT, for_page
from app.head_filter import HeadFilter
from app.schemas.heads import HeadScores
from circuits_core.errors import InvalidInputError

MARKUP = "<b>x</b><br>&amp;"


def test_token_markup_is_escaped_everywhere_it_is_drawn() -> None:
    tokens = [SimpleNamespace(text=MARKUP, id=1), SimpleNamespace(text="a", id=2)]
    fig = view_figures.attention_heatmap(tokens, [[1.0, 0.0], [0.5, 0.5]], f"title {MARKUP}")
    bars = charts.bars([MARKUP, "b"], [1.0, -1.0], title=MARKUP)
    for f in (fig, bars):
        page = for_page(f)
        trace = page["data"][0]
        drawn = [*trace["x"], *trace["y"], page["layout"]["title"]["text"]]
        assert not any("<b>" in str(s) or "<br>" in str(s) for s in drawn)
        assert any(html.unescape(str(s)).startswith(MARKUP) for s in drawn)  # plotly turns entities back
        assert "<extra></extra>" in trace["hovertemplate"]  # the app's own markup is kept
    assert fig["data"][0]["x"][0] == MARKUP  # the figure itself (and its JSON twin) is not changed


def test_every_figure_height_is_capped() -> None:
    names = [f"L{layer}H{h}" for layer in range(30) for h in range(9)]
    z = [[0.1] * len(names) for _ in names]
    fig = charts.heatmap(z, names, names, height=26 * len(names) + 140)
    assert fig["layout"]["height"] > MAX_HEIGHT and for_page(fig)["layout"]["height"] == MAX_HEIGHT


def _view(n_layers: int, n_heads: int) -> SimpleNamespace:
    """A composition view of made-up scores: pair (a, b) scores a*100 + b (by index), baseline 0."""
    sources = [f"L{layer}H{h}" for layer in range(n_layers - 1) for h in range(n_heads)]
    targets = [f"L{layer}H{h}" for layer in range(1, n_layers) for h in range(n_heads)]
    scores = [
        [
            (i * 1000 + j) / 1e5 if int(s[1:].split("H")[0]) < int(t[1:].split("H")[0]) else None
            for j, t in enumerate(targets)
        ]
        for i, s in enumerate(sources)
    ]
    return SimpleNamespace(
        kind="K", sources=sources, targets=targets, scores=scores, minus_baseline=scores, baseline=0.0
    )


def test_block_map_holds_each_blocks_strongest_pair() -> None:
    view = _view(30, 9)
    assert block_heatmaps.needs_blocks(len(view.sources)) and not block_heatmaps.needs_blocks(12)
    fig = block_heatmaps.composition_block_map(view, None, lambda a, b: f"?block={a}-{b}")
    trace = fig["data"][0]
    assert len(trace["y"]) == 29 and len(trace["x"]) == 29
    for a in range(29):
        for b in range(1, 30):
            cell = trace["z"][a][b - 1]
            # brute force over the block's cells
            block = [
                (view.minus_baseline[i][j], s, t)
                for i, s in enumerate(view.sources)
                for j, t in enumerate(view.targets)
                if s.startswith(f"L{a}H") and t.startswith(f"L{b}H") and view.minus_baseline[i][j] is not None
            ]
            if not block:
                assert cell is None and fig["links"]["0"][a][b - 1] is None
                continue
            best = max(block)
            assert cell == pytest.approx(best[0], abs=5e-5) and trace["customdata"][a][b - 1] == [best[1], best[2]]
            assert fig["links"]["0"][a][b - 1] == f"?block={a}-{b}"


def test_block_zoom_writes_values_in_its_cells_and_links_pairs() -> None:
    view = _view(30, 9)
    fig = block_heatmaps.composition_block(view, "m", None, 16, 18)
    trace = fig["data"][0]
    assert trace["y"] == [f"L16H{h}" for h in range(9)] and trace["x"] == [f"L18H{h}" for h in range(9)]
    assert "texttemplate" in trace
    i, j = view.sources.index("L16H0"), view.targets.index("L18H6")
    assert trace["z"][0][6] == pytest.approx(view.minus_baseline[i][j], abs=5e-5)
    assert fig["links"]["0"][0][6] == "/models/m/composition/L16H0/L18H6"
    assert block_heatmaps.composition_block(view, "m", None, 18, 16) is None  # no pair: layer 18 is not below 16
    assert block_heatmaps.composition_block(view, "m", None, 40, 41) is None  # outside the model
    assert fig["layout"]["height"] <= MAX_HEIGHT


def _heads() -> list[HeadScores]:
    return [
        HeadScores(
            head=f"L{layer}H{h}",
            layer=layer,
            index=h,
            ov_copying=None,
            qk_copying=None,
            previous_token=(layer * 7 + h) % 10 / 10,
            current_token=None,
            first_token=None,
            duplicate_token=None,
            induction=(layer * 3 + h * 5) % 11 / 10,
        )
        for layer in range(30)
        for h in range(9)
    ]


def test_head_filter_keeps_what_its_clauses_say() -> None:
    heads = _heads()
    kept = HeadFilter.parse("induction > 0.4 and layer < 20").apply(heads)
    assert kept == [s for s in heads if s.induction is not None and s.induction > 0.4 and s.layer < 20]
    assert 0 < len(kept) < len(heads)
    same = HeadFilter.parse("Induction>0.4, layer<20").apply(heads)
    assert same == kept
    assert HeadFilter.parse("previous token >= 0.9").apply(heads) == [s for s in heads if s.previous_token >= 0.9]
    assert HeadFilter.parse("").apply(heads) == heads and not HeadFilter.parse(" ")
    assert HeadFilter.parse("ov_copying > 0").apply(heads) == []  # None never passes
    assert str(HeadFilter.parse("induction>0.4 and layer<20")) == "induction > 0.4 and layer < 20"


@pytest.mark.parametrize("bad", ["induction", "nonsense > 1", "layer >> 2", "layer < x", "x" * 300])
def test_unreadable_filters_are_refused_with_the_syntax(bad: str) -> None:
    with pytest.raises(InvalidInputError, match="filter"):
        HeadFilter.parse(bad)


def test_smollm2_chapter_figures_come_from_each_sentences_values() -> None:
    """The tour page draws R1-R3 from the values their sentences state (the chapter had no figures); the values
    here are made up, the real ones are checked on the model in tests/app/test_tour_rotary.py."""
    from app.routers.pages_tour import figure_parts
    from app.schemas.heads import DetectorInput
    from app.tour.figure_data import TourData, TourFigure
    from app.tour.rotary import FIGURE_CHARTS
    from app.tour.rotary_claims import InductionHeadsClaim, KCompositionSource, LogitByOrderClaim, ScoreTermsClaim

    source = KCompositionSource(
        target="L18H6", source="L16H0", min=0.2, max=0.3, peak_offset=1, profile=[0.2, 0.3, 0.25]
    )
    detector_input = DetectorInput(kind="repeated_random", seq_len=20, batch=2, seed=0, bos=1, n_tokens=41)
    claims = {
        "R1": InductionHeadsClaim(
            induction=[("L18H6", 0.9)],
            previous_token=[("L16H0", 0.8), ("L3H1", 0.5)],
            kernel_peaks={"L16H0": 1, "L3H1": 1},
            k_sources=[source],
            baseline=0.1,
            input=detector_input,
        ),
        "R2": LogitByOrderClaim(
            tokens=[1, 2, 3],
            position=39,
            target=3,
            value=4.5,
            rank=1,
            order0=1.0,
            order1=4.0,
            remainder=-0.5,
            top_path=["L18H6"],
            top_value=3.0,
        ),  # fmt: skip
        "R3": ScoreTermsClaim(
            head="L18H6", query=39, key=21, score=7.0, attention=0.9, top_terms=[("embed", "L16H0", 5.0)]
        ),
    }
    drawn = {}
    for fid, claim in claims.items():
        fig = TourFigure(
            id=fid,
            title="",
            anchor="",
            look_for="",
            model="m",
            link=None,
            api=None,
            available=True,
            data=TourData(claim=claim.model_dump(), claim_chart=FIGURE_CHARTS[fid]),
        )
        drawn[fid] = figure_parts(fig)["charts"]
    assert drawn["R1"][0]["data"][0]["y"] == [0.9, 0.8, 0.5]
    assert drawn["R1"][1]["data"][0]["y"] == [0.2, 0.3, 0.25] and drawn["R1"][1]["data"][1]["y"] == [0.1] * 3
    assert drawn["R2"][0]["data"][0]["y"] == [1.0, 4.0, -0.5, 4.5]  # the waterfall ends at the model's logit
    assert drawn["R3"][0]["data"][0]["y"] == [5.0]
