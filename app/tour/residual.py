"""The tour's "residual stream as a communication channel" section (docs/maths.md §3, F2-F4) on toy-2l.

Three figures, each a general sentence and a sentence generated from values measured on the shipped model
(never written by hand); tests/app/test_residual_tour.py recomputes every value independently (dense float64
products and SVDs of the served weights) and fails when a sentence stops being true:
  F2  the channel: how many writer x reader pairs there are and how many head -> head pairs read more than the
      random baseline, and the strongest pair;
  F3  virtual weights: the strongest reader of the token embedding and its top singular direction as tokens;
  F4  subspaces and bandwidth: the writers' 90 % subspaces against d_model, the most crowded direction, and the
      strongest erasure (memory-management) candidate.
`residual_chapter(registry, limits)` returns the figures; without the model they say so (`available: false`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from app.registry import ModelRegistry
from app.settings import Limits
from app.tour.chapter import ChapterFigure, Measured, chapter_figures, load_or_reason
from app.tour.figure_data import TourFigure
from app.tour.paper_claims import BandwidthClaim, ChannelClaim, EmbeddingReaderClaim, FigureClaim
from app.views.shared.inputs import token_text
from app.views.shared.residual_inputs import ignored_note
from circuits_core.circuits import erasure as stream_erasure
from circuits_core.circuits import residual_stream as rs
from circuits_core.circuits import stream_components as sc
from circuits_core.circuits import virtual_weight_table as vwt
from circuits_core.circuits import virtual_weights as vw
from circuits_core.cost import Cost
from circuits_core.formats.checkpoint import LoadedModel

PAPER = "https://transformer-circuits.pub/2021/framework/index.html"
TOUR_MODEL = "toy-2l"
N_TOKENS = 5
SPECS = (
    (
        "F2",
        "The residual stream as a communication channel",
        "#residual-comms",
        "Every layer reads from the residual stream and writes to it through linear maps; a reader can only use what "
        "an earlier writer put there, in the subspace it reads.",
    ),
    (
        "F3",
        "Virtual weights",
        "#residual-comms",
        "The product W_w W_r of a writer's output map and a later reader's input map (the paper's W_I W_O) says how "
        "much, and what, the reader reads of what the writer wrote; head -> head it is the composition score.",
    ),
    (
        "F4",
        "Subspaces and residual stream bandwidth",
        "#residual-comms",
        "Writers share d_model: where their subspaces overlap they interact, where they are disjoint they stay "
        "independent, and a head that reads a subspace and writes back its negative erases it (memory management).",
    ),
)


def channel(loaded: LoadedModel) -> tuple[str, ChannelClaim]:
    s = vwt.all_scores(loaded.model)
    heads = [
        (i, j)
        for i, w in enumerate(s.writers)
        for j, r in enumerate(s.readers)
        if w.kind == "head" and r.role in ("Q", "K", "V") and bool(s.mask[i, j])
    ]
    above = sum(float(s.raw[i, j]) > s.baseline for i, j in heads)
    best = int(torch.where(s.mask, s.raw, torch.full_like(s.raw, -1.0)).argmax())
    bi, bj = divmod(best, len(s.readers))
    w, r, score = s.writers[bi].name, s.readers[bj].name, float(s.raw[bi, bj])
    sentence = (
        f"{TOUR_MODEL} has {len(s.writers)} writers and {len(s.readers)} readers ({int(s.mask.sum())} pairs where the "
        f"reader sees the writer); {above} of its {len(heads)} head -> head Q/K/V pairs score above the random "
        f"baseline {s.baseline:.4f} (1/sqrt(d_model)); the strongest pair is {w} -> {r} ({score:.3f})."
    )
    return sentence, ChannelClaim(
        writers=len(s.writers),
        readers=len(s.readers),
        pairs=int(s.mask.sum()),
        head_pairs=len(heads),
        above=above,
        baseline=s.baseline,
        best=(w, r, score),
    )


def embedding_reader(loaded: LoadedModel) -> tuple[str, EmbeddingReaderClaim]:
    s = vwt.all_scores(loaded.model)
    e = [w.name for w in s.writers].index("embed")
    j = int(torch.where(s.mask[e], s.raw[e], torch.full_like(s.raw[e], -1.0)).argmax())
    reader = s.readers[j]
    rep = vw.pair_report(loaded.model, sc.Writer("embed"), reader, k=1, n_top=N_TOKENS)
    d = rep.directions[0]
    assert d.input_top is not None and d.input_bottom is not None
    top = [token_text(loaded, t) for t, _ in d.input_top]
    bottom = [token_text(loaded, t) for t, _ in d.input_bottom]
    sentence = (
        f"The token embedding's strongest reader is {reader.name} (score {rep.score:.3f}, baseline "
        f"{rep.baseline:.4f}); its top singular direction (sigma {d.value:.3f}) weighs the tokens "
        f"{', '.join(map(repr, top))} against {', '.join(map(repr, bottom))}. {ignored_note(loaded.model)}"
    )
    return sentence, EmbeddingReaderClaim(
        reader=reader.name,
        score=rep.score,
        sigma=d.value,
        top=[t for t, _ in d.input_top],
        bottom=[t for t, _ in d.input_bottom],
    )


def bandwidth(loaded: LoadedModel) -> tuple[str, BandwidthClaim]:
    spec = rs.spectra(loaded.model)
    u = rs.stream_usage(loaded.model, spec=spec)
    er = stream_erasure.erasure(loaded.model, spec=spec)
    bw = u.bandwidth
    load, sharers = bw.crowded[0]
    sentence = (
        f"The writers' {100 * rs.ENERGY:.0f} % subspaces add up to {bw.total_dims} dimensions in d_model = "
        f"{bw.d_model} ({bw.uniform_load:.2f} per direction if spread evenly); they use {bw.used_dims:.1f} "
        f"effective directions, and the most crowded one carries {load:.2f} writer subspaces, mostly "
        f"{sharers[0][0]} and {sharers[1][0]}."
    )
    erasure: tuple[str, str, float, float] | None = None
    if er.candidates:
        c = er.candidates[0]
        sentence += (
            f" Strongest erasure candidate: {c.eraser} reads {c.writer}'s subspace and writes back its negative "
            f"(erasure score {c.score:.3f}, z {c.z:.1f} against the same head on random subspaces of that size, read "
            f"share {c.read_share:.2f} vs "
            f"{c.random_share:.2f} for a random subspace) -- weights only: whether it attends to the same "
            "position is not checked."
        )
        erasure = (c.writer, c.eraser, c.score, c.z)
    else:
        sentence += (
            f" No head writes back the negative of an earlier writer's subspace beyond z = {er.threshold_z:.0f}."
        )
    return sentence, BandwidthClaim(
        total_dims=bw.total_dims,
        d_model=bw.d_model,
        used_dims=bw.used_dims,
        crowded_load=load,
        crowded_writers=[sharers[0][0], sharers[1][0]],
        erasure=erasure,
    )


# figure id -> (its measure, its page below /models/{model})
MEASURE: dict[str, tuple[Callable[[LoadedModel], tuple[str, FigureClaim]], str]] = {
    "F2": (channel, "residual"),
    "F3": (embedding_reader, "residual/embed/{reader}"),
    "F4": (bandwidth, "residual/usage"),
}


def residual_chapter(registry: ModelRegistry, limits: Limits) -> list[TourFigure]:
    """F2-F4 on toy-2l; `available: false` with the reason when the model or a figure cannot be computed."""

    def measured(fig: ChapterFigure, loaded: LoadedModel) -> Measured:
        measure, path = MEASURE[fig.id]
        sentence, values = measure(loaded)
        path = path.format(reader=values.reader if isinstance(values, EmbeddingReaderClaim) else "")
        return Measured(sentence, values, f"/models/{TOUR_MODEL}/{path}", f"/api/v1/models/{TOUR_MODEL}/{path}")

    figures = [ChapterFigure(fid, title, f"{PAPER}{anchor}", look_for) for fid, title, anchor, look_for in SPECS]
    return chapter_figures(registry, TOUR_MODEL, figures, measured)


def residual_chapter_cost(registry: ModelRegistry, limits: Limits) -> Cost:
    """F2-F4 one after another on toy-2l: the all-pairs scores (twice), one embedding pair report (priced as the
    largest one, embed -> unembed), the usage scan and the erasure scan; nothing when the model is missing."""
    loaded = load_or_reason(registry, TOUR_MODEL)
    if isinstance(loaded, str):
        return Cost(0)
    m = loaded.model
    scores = vwt.all_scores_cost(m)
    pair = vw.pair_cost(m, sc.Writer("embed"), sc.Reader("unembed"), 1, N_TOKENS)
    return scores.then(scores).then(pair).then(rs.usage_cost(m)).then(stream_erasure.erasure_cost(m))
