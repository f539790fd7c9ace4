"""The tour's real-model chapter: the paper's induction story on SmolLM2-135M, a rotary,
grouped-query Llama-family model (models/smollm2-135m, `make smollm2`).

Three figures, each with a general sentence and a sentence generated from values measured on the model (never
written by hand); tests/app/test_tour_rotary.py recomputes every value independently on the real model (plain
forward passes, dense float64 matrices, rotations at absolute positions) and fails when a sentence stops being
true:
  R1  its induction heads and the previous-token heads feeding them: detector scores, each previous-token head's
      positional-kernel peak, and the K-composition profile over δ of each induction head's strongest source;
  R2  the path expansion of a repeated token's logit (orders 0, 1 and the rest);
  R3  the QK path expansion of the strongest induction head's score on its induction target.
Without the model the figures say so (`available: false`); the rest of the tour is unaffected.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

import torch

from app.params import NoParams
from app.registry import ModelRegistry
from app.settings import Limits
from app.tour.chapter import ChapterFigure, Measured, chapter_figures, load_or_reason
from app.tour.figure_data import ClaimChart, TourFigure
from app.tour.rotary_claims import (
    InductionHeadsClaim,
    KCompositionSource,
    LogitByOrderClaim,
    RotaryClaim,
    ScoreTermsClaim,
)
from app.views.shared.heads_table import build_heads_view
from circuits_core.circuits import composition_rotary, rotary
from circuits_core.circuits.rotary import KERNEL_WINDOW
from circuits_core.cost import Cost
from circuits_core.errors import QkovError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import head_name, parse_head
from circuits_core.prompt import detectors as heads
from circuits_core.prompt import head_table, paths, qk_paths
from circuits_core.prompt.frozen import frozen_run
from circuits_core.prompt.paths import expand_logits
from circuits_core.prompt.qk_paths import expand_scores

TOUR_MODEL = "smollm2-135m"
THRESHOLD = 0.4  # a head "is" a previous-token / induction head above this detector score
REPEAT = 20  # R2/R3 input: BOS + r + r, r = REPEAT token ids drawn uniformly (seed 0)
PAPER = "https://transformer-circuits.pub/2021/framework/index.html"
API = "/api/v1"


def repeated_tokens(loaded: LoadedModel) -> torch.Tensor:
    """[1 + 2 REPEAT] BOS + r + r with r drawn uniformly from the vocabulary (seed 0)."""
    cfg = loaded.model.cfg
    r = torch.randint(0, cfg.d_vocab, (REPEAT,), generator=torch.Generator().manual_seed(0))
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else 0
    return torch.cat([torch.tensor([bos]), r, r])


def _fmt_heads(rows: list[tuple[str, float]]) -> str:
    return ", ".join(f"{h} ({v:.2f})" for h, v in rows)


# -- R1: induction heads and their previous-token sources ------------------------------------------------
def induction_circuit(loaded: LoadedModel, limits: Limits) -> tuple[str, InductionHeadsClaim]:
    model = loaded.model
    table = build_heads_view(loaded, NoParams(), limits)
    inp = table.detector_input
    induction = sorted(
        ((s.head, s.induction or 0.0) for s in table.heads if (s.induction or 0.0) > THRESHOLD), key=lambda x: -x[1]
    )
    previous = sorted(
        ((s.head, s.previous_token or 0.0) for s in table.heads if (s.previous_token or 0.0) > THRESHOLD),
        key=lambda x: -x[1],
    )
    peaks = {s.head: s.kernel_peak_offset for s in table.heads}
    prev_peaks = {h: peaks[h] for h, _ in previous}
    offsets = torch.arange(KERNEL_WINDOW + 1)
    sources: list[KCompositionSource] = []
    for target, _ in induction:
        lt = parse_head(target, model.cfg)[0]
        best: tuple[str, torch.Tensor] | None = None
        for source, _ in previous:
            if parse_head(source, model.cfg)[0] < lt:
                prof = composition_rotary.pair_profile(model, source, target, "k", offsets)  # [65]
                if best is None or float(prof.max()) > float(best[1].max()):
                    best = (source, prof)
        if best is not None:
            sources.append(
                KCompositionSource(
                    target=target,
                    source=best[0],
                    min=float(best[1].min()),
                    max=float(best[1].max()),
                    peak_offset=int(best[1].argmax()),
                    profile=best[1].tolist(),
                )
            )
    cfg = model.cfg
    baseline, _ = composition_rotary.random_baseline(cfg.d_model, cfg.d_head, cfg.group_size)
    same_peak = sorted({p for p in prev_peaks.values() if p is not None})
    sentence = (
        f"On {inp.batch} sequences of BOS + r + r ({inp.seq_len} random tokens repeated, seed {inp.seed}), "
        f"{len(induction)} heads have an induction score above {THRESHOLD}: {_fmt_heads(induction)}. "
        f"{len(previous)} heads have a previous-token score above {THRESHOLD}: {_fmt_heads(previous)}; "
        + (
            f"the positional kernel of every one of them peaks at δ = {same_peak[0]}. "
            if len(same_peak) == 1
            else f"their positional kernels peak at δ = {', '.join(str(prev_peaks[h]) for h, _ in previous)}. "
        )
    )
    if sources:
        parts = [f"{s.target} ← {s.source} ({s.min:.3f}–{s.max:.3f})" for s in sources]
        sentence += (
            f"The strongest K-composition source of each induction head among these previous-token heads, "
            f"with C_K over δ = 0–{KERNEL_WINDOW} (random baseline {baseline:.3f}): {'; '.join(parts)}."
        )
    values = InductionHeadsClaim(
        induction=induction,
        previous_token=previous,
        kernel_peaks=prev_peaks,
        k_sources=sources,
        baseline=baseline,
        input=inp,
    )
    return sentence, values


# -- R2: path expansion of a repeated token's logit --------------------------------------------------------
def repeated_logit(loaded: LoadedModel) -> tuple[str, LogitByOrderClaim]:
    model = loaded.model
    tokens = repeated_tokens(loaded)
    p = 2 * REPEAT - 1  # in the second copy; the next token repeats the one REPEAT positions earlier
    target = int(tokens[p + 1])
    run = frozen_run(model, tokens)
    exp = expand_logits(model, tokens, target, positions=p, max_order=1, by_source=False, run=run)
    totals = exp.order_totals()[:, 0]  # [2]
    value = float(exp.value[0])
    rank = int((run.logits[p] > run.logits[p, target]).sum()) + 1
    heads = [
        (path, float(v))
        for path, o, v in zip(exp.paths, exp.orders.tolist(), exp.values[:, 0].tolist(), strict=True)
        if o == 1
    ]
    top_path, top_value = max(heads, key=lambda x: abs(x[1]))
    sentence = (
        f"On BOS + r + r ({REPEAT} random tokens, seed 0), position {p} holds a repeated token; the logit of the token "
        f"that followed it the first time is {value:.2f} (rank {rank} of {model.cfg.d_vocab}). With the attention "
        f"patterns and norm scales frozen it splits into order 0 (embedding and MLP outputs read by the unembedding) "
        f"{float(totals[0]):.2f}, order 1 (through one head) {float(totals[1]):.2f} and longer paths "
        f"{float(exp.remainder[0]):.2f}; the largest single order-1 term is {' → '.join(top_path)} ({top_value:+.2f})."
    )
    values = LogitByOrderClaim(
        tokens=tokens.tolist(),
        position=p,
        target=target,
        value=value,
        rank=rank,
        order0=float(totals[0]),
        order1=float(totals[1]),
        remainder=float(exp.remainder[0]),
        top_path=list(top_path),
        top_value=top_value,
    )
    return sentence, values


# -- R3: QK path expansion of an induction head's score ----------------------------------------------------
def induction_score_terms(loaded: LoadedModel, head: str) -> tuple[str, ScoreTermsClaim]:
    model = loaded.model
    tokens = repeated_tokens(loaded)
    layer, h = parse_head(head, model.cfg)
    p = 2 * REPEAT - 1
    j = p - REPEAT + 1  # the token after the previous occurrence of the query's token: the induction target
    run = frozen_run(model, tokens)
    exp = expand_scores(model, tokens, (layer, h), run=run)
    terms = exp.q_parts[:, p] @ exp.k_parts[:, j].T / exp.scale  # [C, C]
    C = len(exp.components)
    order = terms.flatten().abs().argsort(descending=True, stable=True)[:3].tolist()  # ties: (query, key) order
    top = [(exp.components[i // C], exp.components[i % C], float(terms.flatten()[i])) for i in order]
    score, attention = float(exp.scores[p, j]), float(run.patterns[layer, h, p, j])
    first = top[0]
    sentence = (
        f"{head_name(layer, h)}'s score from the query at position {p} to its induction target {j} (the token after "
        f"the query token's previous occurrence) is {score:.2f}, attention {attention:.2f}. Split into query-side × "
        f"key-side components of the residual stream, each rotated at its own position, the largest term is "
        f"({first[0]} query, {first[1]} key) = {first[2]:+.2f}; the next are "
        + "; ".join(f"({a}, {b}) = {v:+.2f}" for a, b, v in top[1:])
        + "."
    )
    values = ScoreTermsClaim(head=head_name(layer, h), query=p, key=j, score=score, attention=attention, top_terms=top)
    return sentence, values


# -- the chapter -------------------------------------------------------------------------------------------
def _links(path: str, params: dict[str, Any], api_path: str | None = None) -> tuple[str, str]:
    """(page URL, API URL) of a figure's full view; the API path defaults to the page's."""
    query = f"?{urlencode(params)}" if params else ""
    return (
        f"/models/{TOUR_MODEL}{path}{query}",
        f"{API}/models/{TOUR_MODEL}{api_path if api_path is not None else path}{query}",
    )


SPECS = (
    (
        "R1",
        "SmolLM2: induction heads and the previous-token heads feeding them",
        "#analyzing-a-two-layer-model",
        "Induction heads attend to the token after the previous occurrence of the current token; they find it through "
        "K-composition with a previous-token head, whose positional kernel peaks at δ = 1.",
    ),
    (
        "R2",
        "SmolLM2: path expansion of a repeated token's logit",
        "#path-expansion-of-logits",
        "With patterns and norm scales frozen the logit is a sum of path terms, here grouped by order.",
    ),
    (
        "R3",
        "SmolLM2: QK path expansion of an induction head's score",
        "#path-expansion-of-attention-scores-qk-circuit",
        "The score splits into (query component, key component) terms; K-composition shows as a key-side term read "
        "through a previous-token head.",
    ),
)


def _measure(fid: str, loaded: LoadedModel, limits: Limits, strongest: str | None) -> tuple[str, RotaryClaim, str, str]:
    """(sentence, values, page URL, API URL) of one figure."""
    if fid == "R1":
        sentence, values = induction_circuit(loaded, limits)
        if values.k_sources:  # the pair page of the strongest induction head and its K-composition source
            first = values.k_sources[0]
            pair = f"/composition/{first.source}/{first.target}"
            return sentence, values, _links(pair, {})[0], _links(pair, {}, f"{pair}/profile")[1]
        return sentence, values, _links("", {})[0], f"{API}/models/{TOUR_MODEL}/heads"
    if fid == "R2":
        sentence, by_order = repeated_logit(loaded)
        params = {
            "tokens": ",".join(map(str, by_order.tokens)),
            "position": by_order.position,
            "target": by_order.target,
            "max_order": 1,
        }
        return (sentence, by_order, *_links("/prompt", params, "/paths"))
    if strongest is None:
        raise QkovError("no induction head above the threshold (figure R1)")
    sentence, terms = induction_score_terms(loaded, strongest)
    tokens = ",".join(map(str, repeated_tokens(loaded).tolist()))
    at = {"head": strongest, "tokens": tokens, "query": terms.query, "key": terms.key}  # the page lists them
    return (sentence, terms, *_links("/qk-paths", at))


FIGURE_CHARTS: dict[str, ClaimChart] = {"R1": "induction_heads", "R2": "logit_by_order", "R3": "score_terms"}


def rotary_chapter(registry: ModelRegistry, limits: Limits) -> list[TourFigure]:
    """The three SmolLM2 figures; `available: false` with the reason when the model or a figure cannot be computed."""
    strongest: list[str] = []  # R1's strongest induction head, whose score terms R3 expands

    def measured(fig: ChapterFigure, loaded: LoadedModel) -> Measured:
        sentence, values, link, api = _measure(fig.id, loaded, limits, strongest[0] if strongest else None)
        if isinstance(values, InductionHeadsClaim) and values.induction:
            strongest.append(values.induction[0][0])
        return Measured(sentence, values, link, api, claim_chart=FIGURE_CHARTS[fig.id])

    figures = [ChapterFigure(fid, title, f"{PAPER}{anchor}", look_for) for fid, title, anchor, look_for in SPECS]
    return chapter_figures(registry, TOUR_MODEL, figures, measured, hint="make smollm2")


def chapter_cost(registry: ModelRegistry, limits: Limits) -> Cost:
    """The chapter's engine costs, one after another: the heads table (detectors, copying, kernel peaks), the K
    profiles of every (previous-token, induction) pair, the order-1 path expansion and the QK terms (free when the
    model is not installed). Loads the model, as the chapter itself does."""
    loaded = load_or_reason(registry, TOUR_MODEL, hint="make smollm2")
    if isinstance(loaded, str):
        return Cost(0)
    model = loaded.model
    n, rep = 1 + 2 * REPEAT, min(2 * heads.STANDARD_SEQ_LEN + 1, model.cfg.n_ctx)
    parts = [
        head_table.head_table_cost(model, rep, heads.STANDARD_BATCH, limits.matrix_budget_bytes),
        rotary.kernel_cost(model, KERNEL_WINDOW + 1, min(len(rotary.REFERENCE_TEXT), model.cfg.n_ctx)),
        composition_rotary.pair_profile_cost(model, KERNEL_WINDOW + 1),
        paths.cost(model, n, 1),
        qk_paths.cost(model, model.cfg.n_layers - 1, n, 3),
    ]
    total = Cost(0)
    for part in parts:
        total = total.then(part)
    return total
