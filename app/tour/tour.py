"""The paper tour: figures F6-F30 of docs/maths.md §3 computed on the shipped toy models.

Each figure names the model it uses (toy-0l, toy-1l or toy-2l in checkpoints/), the paper anchor, one general
sentence of what to look for followed, for a computed figure, by a sentence generated from the values measured on
that model (claims.py; tests/app/tour_claims/test_claims.py and test_claims_induction.py recompute them
independently), the dashboard page and JSON API URLs of the full view, and the data, which comes from the same
builders as those views (so the tour and the views cannot disagree). A model that is not installed or cannot be
loaded, or a figure whose computation fails, yields `available: false` with the reason; the other figures are still
computed. Static figures (diagrams, equations) carry no data.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from app.registry import ModelRegistry
from app.settings import Limits
from app.tour import figures as figs
from app.tour.chapter import load_or_reason
from app.tour.claims import BASELINE_SAMPLES, BASELINE_TOP_SAMPLES, CLAIMS
from app.tour.figure_data import TourData, TourFigure, TourView
from app.tour.gemma3 import GEMMA3_MODEL, gemma3_chapter, gemma3_chapter_cost
from app.tour.residual import TOUR_MODEL as RESIDUAL_MODEL
from app.tour.residual import residual_chapter, residual_chapter_cost
from app.tour.rotary import TOUR_MODEL as ROTARY_MODEL
from app.tour.rotary import chapter_cost, rotary_chapter
from circuits_core.circuits import composition, copying
from circuits_core.circuits import head_circuits as circuits
from circuits_core.cost import Cost
from circuits_core.errors import QkovError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.prompt import ablation, head_table, paths, qk_paths
from circuits_core.prompt import detectors as heads

log = logging.getLogger("qkov.tour")

PAPER = "https://transformer-circuits.pub/2021/framework/index.html"
TOUR_MODELS = ("toy-0l", "toy-1l", "toy-2l")
API = "/api/v1"

Compute = Callable[[LoadedModel, Limits], tuple[TourData, str, dict[str, Any]]]


@dataclass(frozen=True)
class Figure:
    id: str
    title: str
    anchor: str
    look_for: str
    model: str | None = None
    compute: Compute | None = None  # -> (data, API path under /api/v1/models/{model}, query parameters)
    static_view: str | None = None  # page of a static figure (no data)


FIGURES: tuple[Figure, ...] = (
    Figure(
        "F6",
        "Zero-layer transformer: the direct path W_E W_U",
        "#zero-layer-transformers",
        "The direct path is a bigram table: row = current token, entries = next-token logits.",
        "toy-0l",
        figs.direct_path,
    ),
    Figure(
        "F7",
        "One-layer attention-only transformer",
        "#onel-path-expansion",
        "Embedding, one attention layer, unembedding: every path goes through at most one head.",
        static_view="/models/toy-1l",
    ),
    Figure(
        "F8",
        "Path expansion, product form",
        "#onel-path-expansion",
        "T = (Id (x) W_U)(Id + sum_h A^h (x) W_OV^h)(Id (x) W_E): multiplying out gives the direct path plus one term "
        "per head.",
    ),
    Figure(
        "F9",
        "Path expansion of a logit, one layer",
        "#onel-path-expansion",
        "With the attention patterns frozen, the direct term and one term per head add up to the logit.",
        "toy-1l",
        figs.paths_order1,
    ),
    Figure(
        "F10",
        "QK and OV circuits of a head",
        "#splitting-attention-head-terms-into-circuits",
        "A copying head puts the source token itself among a row's top outputs.",
        "toy-1l",
        figs.ov_circuit,
    ),
    Figure(
        "F11",
        "Copying skip-trigrams",
        "#interpretation-as-skip-trigrams",
        "Copying skip-trigrams repeat the source ([b] ... [a] -> [b]): compare the -> out column with the source.",
        "toy-1l",
        figs.skip_trigrams,
    ),
    Figure(
        "F12",
        "Split-token copying",
        "#interpretation-as-skip-trigrams",
        "In the paper, outputs continue the source's word fragment rather than repeat it (' Ralph' / 'R' -> 'alph').",
        "toy-1l",
        figs.skip_trigrams_second,
    ),
    Figure(
        "F13",
        "Abstract copying patterns",
        "#interpretation-as-skip-trigrams",
        "A summary diagram of the copying motifs (static).",
    ),
    Figure(
        "F14",
        "Head dump: largest QK entries",
        "#interpretation-as-skip-trigrams",
        "The paper's head dumps list a head's largest QK and OV entries; here one query's row, the comparable reading.",
        "toy-1l",
        figs.qk_circuit,
    ),
    Figure(
        "F15",
        "A primarily positional head",
        "#interpretation-as-skip-trigrams",
        "The pattern of position-only inputs, softmax(mask(W_pos W_QK W_pos^T / s)).",
        "toy-1l",
        figs.positional,
    ),
    Figure(
        "F16",
        "Skip-trigram 'bugs'",
        "#interpretation-as-skip-trigrams",
        "F11's table read as a grid: a head raises the same outputs for every destination that attends to a source, so "
        "it also predicts the combinations the paper calls bugs (keep... in -> bay). The grid is the skip-trigram "
        "view's trigram list (destinations x outs).",
        static_view="/models/toy-1l",
    ),
    Figure(
        "F17",
        "OV eigenvalues of every head",
        "#summarizing-ovqk-matrices",
        "Copying shows as eigenvalues with a positive real part.",
        "toy-1l",
        figs.ov_spectra,
    ),
    Figure(
        "F18",
        "Copying scores",
        "#summarizing-ovqk-matrices",
        "The OV copying score sum(eig)/sum(|eig|) per head, beside a random-weights baseline and token-level shares.",
        "toy-1l",
        figs.copying_scores,
    ),
    Figure(
        "F19",
        "Two-layer path expansion of a logit",
        "#path-expansion-of-logits",
        "Direct, first-order and virtual-head terms of a logit on repeated code.",
        "toy-2l",
        figs.paths_order2,
    ),
    Figure(
        "F20",
        "Two-layer QK expansion",
        "#path-expansion-of-attention-scores-qk-circuit",
        "The induction head's attention scores split into query-side x key-side terms (token, position, earlier "
        "heads).",
        "toy-2l",
        figs.qk_decomposition,
    ),
    Figure(
        "F21",
        "Q-, K- and V-composition",
        "#analyzing-a-two-layer-model",
        "Composition scores between every layer-0 and layer-1 head, minus the random baseline.",
        "toy-2l",
        figs.composition,
    ),
    Figure(
        "F22",
        "Value-weighted attention",
        "#analyzing-a-two-layer-model",
        "Attention weights scaled by the norm of the value vector at the source position.",
        "toy-2l",
        figs.value_weighted,
    ),
    Figure(
        "F23",
        "An induction head's logit effect",
        "#analyzing-a-two-layer-model",
        "As in the paper: the head's effect on the logit of each position's actual next token.",
        "toy-2l",
        figs.induction_effect,
    ),
    Figure(
        "F24",
        "Repeated random tokens",
        "#analyzing-a-two-layer-model",
        "A stripe at offset -T+1 in the induction head, and the loss on each repeat.",
        "toy-2l",
        figs.repeated_tokens,
    ),
    Figure(
        "F25",
        "Induction QK expanded in tokens",
        "#analyzing-a-two-layer-model",
        "The K-composition token circuit: query token against the key's previous token.",
        "toy-2l",
        figs.k_composition,
    ),
    Figure(
        "F26",
        "Eigenvalue positivity of OV and QK (K-composition term)",
        "#checking-the-mechanistic-theory",
        "Induction heads should sit in the corner where both the OV copying score and the K-composition positivity are "
        "near +1.",
        "toy-2l",
        figs.positivity_scatter,
    ),
    Figure(
        "F27",
        "Term importance by path order",
        "#term-importance-analysis",
        "Loss with the paths up to each order (patterns frozen).",
        "toy-2l",
        figs.term_importance,
    ),
    Figure(
        "F28",
        "First-order terms by layer",
        "#term-importance-analysis",
        "Which layer's single-head terms reduce the loss more.",
        "toy-2l",
        figs.term_importance_by_layer,
    ),
    Figure(
        "F29",
        "Virtual attention heads",
        "#virtual-attention-heads",
        "The pattern of a chain is the product of patterns; its OV circuit is the product of OV circuits.",
        "toy-2l",
        figs.virtual_head,
    ),
    Figure(
        "F30",
        "Correction: composition, computed",
        "#analyzing-a-two-layer-model",
        "The paper's published composition diagram was wrong (see its Comments section); F21 above is computed from "
        "the weights, so it is the corrected quantity.",
        static_view="/models/toy-2l/composition?kind=K",
    ),
)


def page_path(api_path: str) -> str:
    """The dashboard page of an API path: a head's circuits live on its page; the heads table and the positivity
    scatter on the overview."""
    if api_path in ("/heads", "/positivity"):
        return ""
    return re.sub(r"^(/heads/[^/]+)/.+$", r"\1", api_path)


def _links(model: str, path: str, params: dict[str, Any]) -> tuple[str, str]:
    query = urlencode({k: v for k, v in params.items() if v is not None})
    suffix = f"?{query}" if query else ""
    return f"/models/{model}{page_path(path)}{suffix}", f"{API}/models/{model}{path}{suffix}"


def _figure(fig: Figure, models: dict[str, LoadedModel | str], limits: Limits) -> TourFigure:
    def figure(
        available: bool,
        link: str | None = None,
        api: str | None = None,
        detail: str | None = None,
        data: TourData | None = None,
        look_for: str | None = None,
    ) -> TourFigure:
        return TourFigure(
            id=fig.id,
            title=fig.title,
            anchor=f"{PAPER}{fig.anchor}",
            look_for=look_for or fig.look_for,
            model=fig.model,
            link=link,
            api=api,
            available=available,
            detail=detail,
            data=data,
        )

    if fig.compute is None or fig.model is None:
        return figure(True, link=fig.static_view)
    loaded = models[fig.model]
    if isinstance(loaded, str):
        return figure(False, detail=loaded)
    look_for = fig.look_for
    try:
        data, path, params = fig.compute(loaded, limits)
        claim = CLAIMS.get(fig.id)
        if claim is not None:  # the measured sentence (claims.py), its values kept in the JSON twin
            sentence, values = claim(loaded, data)
            look_for = f"{fig.look_for} Measured: {sentence}"
            data = data.model_copy(update={"claim": values.measured()})  # typed (paper_claims.py), field for field
    except QkovError as exc:
        log.info("tour figure %s on %s not available: %s", fig.id, fig.model, exc)
        return figure(False, detail=str(exc))
    link, api = _links(fig.model, path, params)
    return figure(True, link=link, api=api, data=data, look_for=look_for)


def tour_models(chapter: str) -> tuple[str, ...]:
    """The models a chapter of the tour reads."""
    if chapter == "smollm2":
        return (ROTARY_MODEL,)
    if chapter == "gemma3":
        return (GEMMA3_MODEL,)
    return tuple(dict.fromkeys((*TOUR_MODELS, RESIDUAL_MODEL)))


def digest_or_dash(registry: ModelRegistry, model_id: str) -> str:
    """The digest of the model's answer-changing files (loading it, as the tour does), or "-" when unavailable."""
    loaded = load_or_reason(registry, model_id)
    return "-" if isinstance(loaded, str) else str(loaded.digest)


def build_tour_view(registry: ModelRegistry, limits: Limits, chapter: str = "paper") -> TourView:
    """Every figure of one chapter of the tour: "paper" (the paper's figures on the toys, with the residual stream
    as a channel) or "smollm2" (rotary circuits on the real model, a page of its own so that the paper chapter
    does not wait for a 135M-parameter model); missing models and failing figures are reported, never raised."""
    if chapter in ("smollm2", "gemma3"):
        figures = (rotary_chapter if chapter == "smollm2" else gemma3_chapter)(registry, limits)
        return TourView(models={f.model: f.available for f in figures[:1] if f.model}, figures=figures)
    models = {m: load_or_reason(registry, m) for m in TOUR_MODELS}
    return TourView(
        models={m: not isinstance(v, str) for m, v in models.items()},
        figures=[*residual_chapter(registry, limits), *(_figure(fig, models, limits) for fig in FIGURES)],
    )


def tour_cost(registry: ModelRegistry, limits: Limits, chapter: str = "paper") -> Cost:
    """The figures run one after another on each installed toy: the largest working memory among the engine cost
    functions of what they compute (circuit top-k, copying with its baseline, the detector pass, paths, term
    importance, composition, QK terms), answers added. Loads the toys, as the tour itself does."""
    if chapter == "smollm2":
        return chapter_cost(registry, limits)
    if chapter == "gemma3":
        return gemma3_chapter_cost(registry, limits)
    total = Cost(0)
    for name in TOUR_MODELS:
        loaded = load_or_reason(registry, name)
        if isinstance(loaded, str):
            continue
        m, b = loaded.model, limits.matrix_budget_bytes
        n = min(m.cfg.n_ctx, limits.max_prompt_tokens)
        rep = min(2 * heads.STANDARD_SEQ_LEN + 1, m.cfg.n_ctx)
        parts = [circuits.top_cost(m, limits.max_k, b, line=False)]
        if m.cfg.n_layers >= 1:
            parts += [
                copying.cost(m, 10, BASELINE_SAMPLES, BASELINE_TOP_SAMPLES, b),
                head_table.head_table_cost(m, rep, heads.STANDARD_BATCH, b),
                heads.detectors_cost(m, rep, heads.STANDARD_BATCH, logits=True),
                paths.cost(m, n, min(2, m.cfg.n_layers)),
            ]
        if m.cfg.n_layers >= 2:
            parts += [ablation.cost(m, n), composition.cost(m, ("k",)), qk_paths.cost(m, m.cfg.n_layers - 1, n, 6)]
        for part in parts:
            total = total.then(part)
    return total.then(residual_chapter_cost(registry, limits))  # the residual-stream section (residual.py)
