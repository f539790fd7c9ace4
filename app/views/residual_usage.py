"""How the residual stream's bandwidth is used (docs/maths.md §2.1): every component's effective rank, the overlaps of
writers' and readers' subspaces, the crowded directions, and the erasure candidates (later heads writing back the
negative of what an earlier writer wrote). Engine: circuits_core/circuits/residual_stream.py, erasure.py.

Declaration (page + JSON): residual/usage.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from app import snippets
from app.analysis import Analysis, AnalysisParams
from app.page_spec import OwnPage
from app.params import BasisChoice
from app.schemas import ModelRef
from app.settings import Limits
from app.views.shared.basis import basis, raw_copy_cost, with_basis
from app.views.shared.inputs import model_ref
from app.views.shared.residual_inputs import Energy, Offset, ignored_note
from circuits_core.circuits import erasure as stream_erasure
from circuits_core.circuits import residual_stream as rs
from circuits_core.cost import Cost
from circuits_core.errors import InvalidInputError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.schedule import side_by_side

ERASURE_SHOWN = 20


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
    writers: list[tuple[str, float]] = Field(
        description="writers loading it most, with u^T U_w U_w^T u; equal shares in the writers' order (docs/maths.md "
        "§1.7)"
    )


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
    spec = rs.spectra(model, p.offset)  # computed once for both scans, which are independent: side by side when a
    u, er = side_by_side(  # core is idle (schedule.py), so both are held at once (usage_cost: their peaks added)
        lambda: rs.stream_usage(model, energy=p.energy, offset=p.offset, spec=spec),
        lambda: stream_erasure.erasure(model, energy=p.energy, spec=spec),
        "qkov-residual-usage",
    )
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
    usage = rs.usage_cost(loaded.model, p.writers_shown)
    return usage + stream_erasure.erasure_cost(loaded.model, ERASURE_SHOWN) + raw_copy_cost(loaded, p.basis)


RESIDUAL_USAGE = Analysis(
    name="residual-usage",
    path="residual/usage",
    params=UsageParams,
    view=UsageView,
    build=build_usage_view,
    cost=usage_cost,
    summary="Residual stream usage",
    snippet=snippets.residual_usage_body,
    tags=["residual stream"],
    page=OwnPage(template="residual_usage.html", nav=140),
)
