"""An MLP writer's token table: the top entries of expert_e(ln2(W_E[t])) W_U for one expert of a mixture, a layer's
shared experts or a dense MLP (circuits_core/circuits/expert_circuits.py, docs/maths.md §7.12), the per-expert
analogue of a head's full OV table; each listed row token with the weight the router gives the expert on it."""

from __future__ import annotations

from typing import Annotated

import torch
from pydantic import Field

from app import snippets
from app.analysis import Analysis
from app.page_spec import OwnPage
from app.params import DirectParams
from app.schemas import CircuitTopView
from app.settings import Limits
from app.views.shared.basis import raw_copy_cost, with_basis
from app.views.shared.global_tables import SHARED_K
from app.views.shared.token_sets import token_set
from app.views.shared.token_tables import top_view
from circuits_core.circuits import expert_circuits
from circuits_core.circuits.stream_components import Writer, parse_writer
from circuits_core.cost import Cost
from circuits_core.errors import InvalidInputError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.transformer import Transformer

FORM = (
    "exact, not linearised: the expert itself (its nonlinearity, biases and clamps) applied to each source token's "
    "embedding through the layer's MLP input norm, its output through W_U, unweighted by the router. It is what a "
    "layer-0 MLP reads where attention writes nothing at the token, and the direct-path reading of later layers"
)


class ExpertParams(DirectParams):
    mlp: Annotated[
        str | None,
        Field(
            max_length=64,
            description="the MLP writer: L<l>.mlp.e<expert> (one expert of a mixture), L<l>.mlp.shared (DeepSeek's "
            "shared experts) or L<l>.mlp (a dense MLP); default: the first mixture's expert 0, else L0.mlp",
        ),
    ] = None


def default_writer(model: Transformer) -> str:
    """The first layer with experts' expert 0, else layer 0's dense MLP; refused on an attention-only model."""
    cfg = model.cfg
    if cfg.attn_only:
        raise InvalidInputError("the model is attention-only: it has no MLP writers to tabulate")
    moe = [layer for layer in range(cfg.n_layers) if cfg.layer_has_experts(layer)]
    return f"L{moe[0]}.mlp.e0" if moe else "L0.mlp"


def writer_of(loaded: LoadedModel, p: ExpertParams) -> Writer:
    model = loaded.model
    writer = parse_writer(model, p.mlp if p.mlp is not None else default_writer(model))
    if writer.kind != "mlp" or writer.neurons is not None:
        raise InvalidInputError(
            f"mlp: {writer.name} is not a whole MLP writer; name L<l>.mlp.e<expert>, L<l>.mlp.shared or L<l>.mlp"
        )
    return writer


def build_expert_view(loaded: LoadedModel, p: ExpertParams, limits: Limits) -> CircuitTopView:
    loaded = with_basis(loaded, p.basis)
    model = loaded.model
    writer = writer_of(loaded, p)
    view = top_view(
        loaded,
        lambda ids: expert_circuits.full_expert_circuit(model, writer, ids),
        "expert",
        None,
        p.token,
        "row",
        p.k,
        limits,
        p.min_count,
        lambda t: expert_circuits.expert_row(model, writer, t),
        p.vocab,
        name=writer.name,
    )
    with torch.no_grad():
        rows = torch.tensor([e.row.id for e in view.entries], dtype=torch.long, device=model.W_E.device)
        weights = expert_circuits.direct_route_weights(model, writer, rows).tolist() if len(rows) else []
    return view.model_copy(update={"mlp": writer.name, "route_weight": weights, "form_note": FORM})


def expert_cost(loaded: LoadedModel, p: ExpertParams, limits: Limits) -> Cost:
    """The writer's row, else its global table on the token set (expert_circuits.expert_table_cost)."""
    writer = writer_of(loaded, p)
    model = loaded.model
    if p.token is not None:  # the row over every token (min_count only filters the ranking)
        cost = expert_circuits.expert_table_cost(model, writer, p.k, limits.matrix_budget_bytes, True)
    else:
        ranked = token_set(loaded, p.min_count, p.vocab)
        shared = max(p.k, min(SHARED_K, ranked.n**2))
        cost = expert_circuits.expert_table_cost(
            model, writer, shared, limits.matrix_budget_bytes, False, None if ranked.ids is None else ranked.n
        )
    said = Cost(0).with_answer(labels=2)  # the writer's name and the form note, beyond the engine's table
    return cost + said + Cost(0, len(FORM.encode())) + raw_copy_cost(loaded, p.basis)


EXPERT_OV = Analysis(
    name="expert-ov",
    path="expert-ov",
    params=ExpertParams,
    view=CircuitTopView,
    build=build_expert_view,
    cost=expert_cost,
    summary="Token table of an expert (or any MLP writer)",
    snippet=snippets.expert_ov_body,
    tags=["circuits"],
    needs_mlp=True,
    page=OwnPage(template="expert.html", nav=125),
)
