"""The residual stream as a communication channel: every writer against every reader, and one virtual weight
(how the writers share d_model: residual_usage.py). Engine: circuits_core/circuits/virtual_weights.py,
virtual_weight_table.py.

Two declarations (page + JSON each):
  residual                        writers x readers scores (score - baseline), grouped by layer
  residual/{writer}/{reader}      one virtual weight: score, singular values, top directions (tokens, positions
                                  or neurons where a side is indexed by them), links to the head / pair pages
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch
from pydantic import BaseModel, Field

from app import snippets
from app.analysis import Analysis, AnalysisParams
from app.page_spec import OwnPage
from app.params import BasisChoice, K
from app.schemas import ModelRef, TokenRef
from app.schemas.common import QKFormed
from app.settings import Limits
from app.views.shared.basis import basis, raw_copy_cost, with_basis
from app.views.shared.inputs import model_ref, qk_form_fields, token_ref
from app.views.shared.residual_inputs import Offset, ignored_note
from circuits_core.circuits import stream_components as sc
from circuits_core.circuits import virtual_weight_table as vwt
from circuits_core.circuits import virtual_weights as vw
from circuits_core.cost import Cost
from circuits_core.formats.checkpoint import LoadedModel


# -- all pairs --------------------------------------------------------------------------------------------
class ResidualParams(AnalysisParams):
    offset: Offset = 0
    basis: BasisChoice = "served"


class ResidualView(QKFormed):
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
    s = vwt.all_scores(model, offset=p.offset)
    return ResidualView(
        model=model_ref(loaded),
        **qk_form_fields(loaded, "weight"),  # the Q and K readers' virtual weights
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
    return vwt.all_scores_cost(loaded.model) + raw_copy_cost(loaded, p.basis)


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
        description="largest entries on the writer's input side (null: a d_model side); equal entries: the lower "
        "index first (docs/maths.md §1.7)"
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


class ResidualPairView(QKFormed):
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
        description="top singular directions; each (input, output) pair is defined up to one common sign, chosen so "
        "that the input side's entry of largest magnitude (in d_model or the indexed side) is positive (docs/maths.md "
        "§1.8)"
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
        **qk_form_fields(loaded, "weight"),
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
    page=OwnPage(template="residual.html", nav=130),
)
RESIDUAL_PAIR = Analysis(
    name="residual-pair",
    path="residual/{writer}/{reader}",
    params=ResidualPairParams,
    view=ResidualPairView,
    build=build_residual_pair_view,
    cost=residual_pair_cost,
    summary="One virtual weight: writer -> reader",
    snippet=snippets.residual_pair_body,
    tags=["residual stream"],
    page=OwnPage(template="residual_pair.html"),  # reached from the residual page's links, not the navigation
)
