"""The residual stream as a communication channel: every writer against every reader, one virtual
weight, and how the writers share d_model. Engine: circuits_core/circuits/virtual_weights.py, residual_stream.py.

Three declarations (page + JSON each):
  residual                        writers x readers scores (score - baseline), grouped by layer
  residual/usage                  effective ranks, subspace overlaps, bandwidth, erasure candidates
  residual/{writer}/{reader}      one virtual weight: score, singular values, top directions (tokens, positions
                                  or neurons where a side is indexed by them), links to the head / pair pages
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, Field

from app import snippets
from app.analysis import Analysis, AnalysisParams
from app.params import BasisChoice, K
from app.schemas import ModelRef, TokenRef
from app.settings import Limits
from app.views.basis import basis, raw_copy_cost, with_basis
from app.views.inputs import model_ref, token_ref
from circuits_core.circuits import residual_stream as rs
from circuits_core.circuits import stream_components as sc
from circuits_core.circuits import virtual_weights as vw
from circuits_core.cost import Cost
from circuits_core.errors import InvalidInputError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.transformer import Transformer

Offset = Annotated[
    int,
    Field(
        ge=0,
        le=1_000_000,
        description=(
            "rotary models: query position - key position at which Q/K readers are read (0: W_Q W_K^T; must be < "
            "n_ctx); other models: 0 only"
        ),
    ),
]
Energy = Annotated[
    float,
    Field(gt=0, le=1, description="a component's subspace = its top singular directions holding this share of sum s^2"),
]
ERASURE_SHOWN = 20


def ignored_note(model: Transformer) -> str:
    """What the paper ignores and qkov ignores with it, for this model (shown on every residual page)."""
    kind = model.cfg.normalization_type
    if kind is None:
        return "This model has no norm between layers, so nothing is left out: these are the exact linear maps."
    name = "RMSNorm" if kind.startswith("RMS") else "LayerNorm"
    folded = kind.endswith("Pre") or bool(model.processing.get("fold_ln"))
    weight = (
        "its weight (and, for LayerNorm, its centring) is folded into these weights"
        if folded
        else "its weight is not folded into these weights and is left out too"
    )
    return (
        f"As in the paper, the {name} between layers is ignored: {weight}; its per-token scale depends on the "
        "input and is left out (the path pages freeze it on a prompt instead). The token embedding is W_E after "
        "layer 0's norm, row by row (exact only when positions are not added to the stream)."
    )


# -- all pairs --------------------------------------------------------------------------------------------
class ResidualParams(AnalysisParams):
    offset: Offset = 0
    basis: BasisChoice = "served"


class ResidualView(BaseModel):
    model: ModelRef
    writers: list[str] = Field(description="rows: embed, pos, then per layer its heads (W_OV) and its MLP (W_out)")
    writer_layers: list[int] = Field(description="layer of each writer (-1: embed, pos)")
    readers: list[str] = Field(
        description="columns: per layer every head's Q (W_QK), K (W_QK^T), V (W_OV), the MLP "
        "input(s) (in, or gate and up), then unembed (W_U)"
    )
    reader_layers: list[int] = Field(description="layer of each reader (n_layers: unembed)")
    scores: list[list[float | None]] = Field(
        description="[writer][reader] ||W_w W_r||_F / (||W_w||_F ||W_r||_F); "
        "null where the reader does not see the writer"
    )
    minus_baseline: list[list[float | None]]
    baseline: float = Field(description="1/sqrt(d_model), composition's random baseline")
    sampled_baseline: float = Field(description="composition's sampled baseline (ARENA's generator)")
    sampled_std: float
    offset: int
    basis: str
    ignored: str


def _table(t: torch.Tensor, mask: torch.Tensor) -> list[list[float | None]]:
    return [
        [float(v) if m else None for v, m in zip(row, mrow, strict=True)]
        for row, mrow in zip(t.tolist(), mask.tolist(), strict=True)
    ]


def build_residual_view(loaded: LoadedModel, p: ResidualParams, limits: Limits) -> ResidualView:
    loaded = with_basis(loaded, p.basis)
    model = loaded.model
    s = vw.all_scores(model, offset=p.offset)
    return ResidualView(
        model=model_ref(loaded),
        writers=[w.name for w in s.writers],
        writer_layers=[w.layer for w in s.writers],
        readers=[r.name for r in s.readers],
        reader_layers=[model.cfg.n_layers if r.role == "unembed" else r.layer for r in s.readers],
        scores=_table(s.raw, s.mask),
        minus_baseline=_table(s.minus_baseline, s.mask),
        baseline=s.baseline,
        sampled_baseline=s.sampled_baseline,
        sampled_std=s.sampled_std,
        offset=p.offset,
        basis=basis(loaded),
        ignored=ignored_note(model),
    )


def residual_cost(loaded: LoadedModel, p: ResidualParams, limits: Limits) -> Cost:
    return vw.all_scores_cost(loaded.model) + raw_copy_cost(loaded, p.basis)


# -- one pair ---------------------------------------------------------------------------------------------
class ResidualPairParams(AnalysisParams):
    writer: Annotated[str, Field(max_length=64, description="embed, pos, L{l}H{h}, L{l}.mlp or L{l}.mlp[n,...]")]
    reader: Annotated[
        str,
        Field(
            max_length=64,
            description="L{l}H{h}.Q|K|V, L{l}.mlp.in (gated: .gate, .up), optionally [n,...] neurons, or unembed",
        ),
    ]
    offset: Offset = 0
    k: K = 5
    n_top: K = 10
    basis: BasisChoice = "served"


class DirectionEntry(BaseModel):
    index: int = Field(description="token id, position or neuron")
    token: TokenRef | None = Field(description="the token, where the side is the vocabulary")
    value: float = Field(description="entry of the unit singular vector")


class DirectionView(BaseModel):
    singular_value: float
    input_top: list[DirectionEntry] | None = Field(
        description="largest entries on the writer's input side (null: a d_model side)"
    )
    input_bottom: list[DirectionEntry] | None
    output_top: list[DirectionEntry] | None = Field(description="largest entries on the reader's output side")
    output_bottom: list[DirectionEntry] | None
    input_tokens_top: list[DirectionEntry] | None = Field(
        default=None, description="a d_model input side read in tokens (input_read): largest"
    )
    input_tokens_bottom: list[DirectionEntry] | None = None
    output_tokens_top: list[DirectionEntry] | None = Field(
        default=None, description="a d_model output side read in tokens (output_read): largest"
    )
    output_tokens_bottom: list[DirectionEntry] | None = None


class ResidualPairView(BaseModel):
    model: ModelRef
    writer: str
    reader: str
    input_space: Literal["tokens", "positions", "neurons", "d_model"]
    output_space: Literal["tokens", "neurons", "d_model"]
    score: float
    baseline: float
    minus_baseline: float
    singular_values: list[float]
    directions: list[DirectionView] = Field(
        description="top singular directions; each (input, output) pair is defined up to one common sign"
    )
    links: dict[str, str] = Field(description="existing pages for this pair or its heads")
    offset: int
    basis: str
    ignored: str
    input_read: str | None = Field(
        default=None,
        description="a d_model input side is read in tokens as W_E u (which tokens, embedded, point along u)",
    )
    output_read: str | None = Field(
        default=None,
        description="a d_model output side read in tokens: 'W_E' (a Q/K reader's other side) or 'W_U' (v W_U: the "
        "logits a V reader's output raises); norms not applied",
    )


def _entries(loaded: LoadedModel, space: str, items: list[tuple[int, float]] | None) -> list[DirectionEntry] | None:
    if items is None:
        return None
    return [
        DirectionEntry(index=i, token=token_ref(loaded, i) if space == "tokens" else None, value=v) for i, v in items
    ]


def _links(model_id: str, writer: sc.Writer, reader: sc.Reader) -> dict[str, str]:
    base = f"/models/{model_id}"
    links = {}
    if writer.kind == "head":
        links["writer head"] = f"{base}/heads/{writer.name}"
    if reader.role in ("Q", "K", "V"):
        head = reader.name.split(".")[0]
        links["reader head"] = f"{base}/heads/{head}"
        if writer.kind == "head":
            links["composition pair"] = f"{base}/composition/{writer.name}/{head}"
    return links


def build_residual_pair_view(loaded: LoadedModel, p: ResidualPairParams, limits: Limits) -> ResidualPairView:
    loaded = with_basis(loaded, p.basis)
    model = loaded.model
    writer, reader = sc.parse_writer(model, p.writer), sc.parse_reader(model, p.reader)
    rep = vw.pair_report(model, writer, reader, k=p.k, n_top=p.n_top, offset=p.offset)
    dirs = [
        DirectionView(
            singular_value=d.value,
            input_top=_entries(loaded, rep.input_space, d.input_top),
            input_bottom=_entries(loaded, rep.input_space, d.input_bottom),
            output_top=_entries(loaded, rep.output_space, d.output_top),
            output_bottom=_entries(loaded, rep.output_space, d.output_bottom),
            input_tokens_top=_entries(loaded, "tokens", d.input_tokens_top),
            input_tokens_bottom=_entries(loaded, "tokens", d.input_tokens_bottom),
            output_tokens_top=_entries(loaded, "tokens", d.output_tokens_top),
            output_tokens_bottom=_entries(loaded, "tokens", d.output_tokens_bottom),
        )
        for d in rep.directions
    ]
    return ResidualPairView(
        model=model_ref(loaded),
        writer=rep.writer,
        reader=rep.reader,
        input_space=rep.input_space,  # type: ignore[arg-type]
        output_space=rep.output_space,  # type: ignore[arg-type]
        score=rep.score,
        baseline=rep.baseline,  # type: ignore[arg-type]
        minus_baseline=rep.score - rep.baseline,
        input_read=rep.input_read,
        output_read=rep.output_read,
        singular_values=rep.singular_values,
        directions=dirs,
        links=_links(loaded.path.name, writer, reader),
        offset=p.offset,
        basis=basis(loaded),
        ignored=ignored_note(model),
    )


def residual_pair_cost(loaded: LoadedModel, p: ResidualPairParams, limits: Limits) -> Cost:
    model = loaded.model
    return vw.pair_cost(
        model, sc.parse_writer(model, p.writer), sc.parse_reader(model, p.reader), p.k, p.n_top, p.offset
    ) + raw_copy_cost(loaded, p.basis)


# -- usage ------------------------------------------------------------------------------------------------
USAGE_ROWS = 64  # writer rows of the overlap tables per answer (a page); the toys' writers all fit in one


class UsageParams(AnalysisParams):
    energy: Energy = rs.ENERGY
    offset: Offset = 0
    basis: BasisChoice = "served"
    writers_from: Annotated[
        int, Field(ge=0, description="first writer row of the overlap tables in this answer (a page of them)")
    ] = 0
    writers_shown: Annotated[
        int, Field(ge=1, le=4096, description=f"writer rows of the overlap tables per answer (default {USAGE_ROWS})")
    ] = USAGE_ROWS


class CrowdedDirection(BaseModel):
    load: float = Field(description="eigenvalue of sum_w U_w U_w^T: how many writer subspaces share this direction")
    writers: list[tuple[str, float]] = Field(description="writers loading it most, with u^T U_w U_w^T u")


class ErasureEntry(BaseModel):
    writer: str
    eraser: str = Field(description="a later head")
    score: float = Field(description="-tr(U^T W_OV U) / (sqrt(k) ||U^T W_OV||_F), in [-1, 1]")
    z: float = Field(
        description="against the same head on uniformly random subspaces of the same dimension (its own null)"
    )
    read_share: float = Field(description="||U^T W_OV||^2 / ||W_OV||^2")
    random_share: float = Field(description="k / d_model: a random subspace's read share")
    eigenvalues: list[tuple[float, float]] = Field(description="(re, im) of the restricted virtual weight U^T W_OV U")


class UsageView(BaseModel):
    model: ModelRef
    energy: float
    writers: list[str]
    readers: list[str]
    effective_rank: dict[str, float] = Field(description="(sum s^2)^2 / sum s^4 of each writer and reader")
    dims: dict[str, int] = Field(description="dimension k of each component's subspace at `energy`")
    overlap: list[list[float]] = Field(
        description="[writer][writers, then readers] mean squared cosine of the principal "
        "angles: 1 identical or nested, 0 orthogonal"
    )
    overlap_excess: list[list[float]] = Field(
        description="(overlap - random) / (1 - random), random = max(k1, k2) / d_model"
    )
    rows: list[str] = Field(description="the writers of this page's overlap rows (writers_from on)")
    writers_from: int
    next_writers_from: int | None = Field(description="writers_from of the next page of rows; None on the last page")
    page: str = Field(description="which rows of the overlap tables this answer holds, in words")
    d_model: int
    total_dims: int = Field(description="sum of the writers' subspace dimensions")
    uniform_load: float = Field(description="total_dims / d_model")
    load: list[float] = Field(description="eigenvalues of sum_w U_w U_w^T, descending")
    used_dims: float = Field(description="participation ratio of the load: how much of d_model the writers use")
    crowded: list[CrowdedDirection]
    erasure_threshold_z: float
    erasure_max_z: float | None = Field(description="largest z over every (earlier writer, later head) pair")
    erasure: list[ErasureEntry] = Field(
        description=f"candidates (z > threshold and read share > random), best {ERASURE_SHOWN}"
    )
    basis: str
    ignored: str


def build_usage_view(loaded: LoadedModel, p: UsageParams, limits: Limits) -> UsageView:
    loaded = with_basis(loaded, p.basis)
    model = loaded.model
    spec = rs.spectra(model, p.offset)  # computed once for both scans
    u = rs.stream_usage(model, energy=p.energy, offset=p.offset, spec=spec)
    er = rs.erasure(model, energy=p.energy, spec=spec)
    bw = u.bandwidth
    n_writers = len(u.writers)
    if p.writers_from >= max(1, n_writers):
        raise InvalidInputError(f"writers_from={p.writers_from}: the model has {n_writers} writers (rows from 0)")
    page = slice(p.writers_from, min(n_writers, p.writers_from + p.writers_shown))
    z = er.z[er.mask]
    return UsageView(
        model=model_ref(loaded),
        energy=p.energy,
        writers=u.writers,
        readers=u.readers,
        effective_rank=u.effective_rank,
        dims=u.dims,
        overlap=u.overlap[page].tolist(),
        overlap_excess=u.overlap_excess[page].tolist(),
        rows=u.writers[page],
        writers_from=page.start,
        next_writers_from=page.stop if page.stop < n_writers else None,
        page=(
            f"all {n_writers} writer rows"
            if page.start == 0 and page.stop >= n_writers
            else f"writer rows {page.start + 1}-{page.stop} of {n_writers} (writers_from={page.start}, "
            f"writers_shown={p.writers_shown}); the next page: writers_from={page.stop}"
            if page.stop < n_writers
            else f"writer rows {page.start + 1}-{page.stop} of {n_writers}, the last page (writers_from={page.start})"
        ),
        d_model=bw.d_model,
        total_dims=bw.total_dims,
        uniform_load=bw.uniform_load,
        load=bw.load,
        used_dims=bw.used_dims,
        crowded=[CrowdedDirection(load=load, writers=ws) for load, ws in bw.crowded],
        erasure_threshold_z=er.threshold_z,
        erasure_max_z=float(z.max()) if z.numel() else None,
        erasure=[
            ErasureEntry(
                writer=c.writer,
                eraser=c.eraser,
                score=c.score,
                z=c.z,
                read_share=c.read_share,
                random_share=c.random_share,
                eigenvalues=[(e.real, e.imag) for e in c.eigenvalues],
            )
            for c in er.candidates[:ERASURE_SHOWN]
        ],
        basis=basis(loaded),
        ignored=ignored_note(model),
    )


def usage_cost(loaded: LoadedModel, p: UsageParams, limits: Limits) -> Cost:
    return rs.usage_cost(loaded.model, p.writers_shown).then(
        rs.erasure_cost(loaded.model, ERASURE_SHOWN)
    ) + raw_copy_cost(loaded, p.basis)


RESIDUAL = Analysis(
    name="residual",
    path="residual",
    params=ResidualParams,
    view=ResidualView,
    build=build_residual_view,
    cost=residual_cost,
    summary="Residual stream (virtual weights)",
    snippet=snippets.residual_body,
    tags=["residual stream"],
)
RESIDUAL_USAGE = Analysis(
    name="residual-usage",
    path="residual/usage",
    params=UsageParams,
    view=UsageView,
    build=build_usage_view,
    cost=usage_cost,
    summary="Residual stream usage",
    tags=["residual stream"],
)
RESIDUAL_PAIR = Analysis(
    name="residual-pair",
    path="residual/{writer}/{reader}",
    params=ResidualPairParams,
    view=ResidualPairView,
    build=build_residual_pair_view,
    cost=residual_pair_cost,
    summary="One virtual weight: writer -> reader",
    tags=["residual stream"],
)
ANALYSES: list[Analysis[Any, Any]] = [RESIDUAL, RESIDUAL_USAGE, RESIDUAL_PAIR]
