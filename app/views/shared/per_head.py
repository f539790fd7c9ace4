"""One number per head, declared from the engine alone: `per_head_analysis(values, cost, ...)` turns an engine function
`values(model) -> [n_layers, n_heads]` and its price `cost(model) -> Cost` into a whole analysis (app/analysis.py):
the JSON answer (`PerHeadView` with the numbers under the declared `field`), its builder and priced cost, the
"copy as Python" snippet (the engine call itself) and the shared per-head page (app/page_spec.py PerHeadPage:
heatmap, a table of every head, a navigation entry at `nav`). A module of app/views binds it, as any declaration:

    QK_CIRCUIT_NORM = per_head_analysis(
        qk_circuit_norm.qk_circuit_norms, qk_circuit_norm.cost, name="qk-circuit-norm", field="norms",
        summary="QK circuit norm of every head", title="QK circuit norm", quantity="||W_Q W_K^T||_F",
        explanation="...", nav=110,
    )

The numbers are the model's weights as served (no params, so no basis choice); tests/app/test_per_head_pages.py walks
every such analysis (the API's answer against its engine function, the page's table and navigation entry) and
tests/app/test_snippets.py runs its snippet against its JSON, so a new one needs only its engine tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field, create_model
from torch import Tensor

from app import snippets
from app.analysis import Analysis
from app.page_spec import PerHeadPage
from app.params import NoParams
from app.schemas import ModelRef
from app.schemas.common import QKFormed
from app.settings import Limits
from app.views.shared.inputs import model_ref, qk_form_fields
from circuits_core.cost import Cost
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.transformer import Transformer


class PerHeadView(BaseModel):
    """What every per-head answer has; its analysis adds the [layer][head] numbers under its own field name."""

    model: ModelRef
    d_head: int = Field(description="dimension of each head's query, key and value")
    group_size: int = Field(description="query heads per key/value head (1 without grouped-query attention)")


class QKPerHeadView(PerHeadView, QKFormed):
    """A per-head answer whose numbers are QK numbers: with the form they are in."""


@dataclass(frozen=True, kw_only=True)
class PerHeadAnalysis(Analysis[NoParams, PerHeadView]):
    """An analysis made by `per_head_analysis`: `values` is its engine function, `field` the view's field holding its
    [layer][head] numbers (the generic tests read both)."""

    values: Callable[[Transformer], Tensor]
    field: str


def per_head_analysis(
    values: Callable[[Transformer], Tensor],
    cost: Callable[[Transformer], Cost],
    *,
    name: str,
    field: str,
    summary: str,
    title: str,
    quantity: str,
    explanation: str,
    nav: int | None,
    digits: int = 4,
    tags: tuple[str, ...] = ("circuits",),
    weights: Literal["attention", "all"] = "attention",
    qk_level: Literal["token", "weight", "prompt"] | None = None,
) -> PerHeadAnalysis:
    """The analysis `name` (also its path) serving `values(model)`, a [n_layers, n_heads] tensor, as `field` of its
    answer, priced by `cost(model)`. `summary` labels it in the API docs and the navigation, `title`, `explanation`
    and `quantity` head its page, its heatmap and its table column. `weights="all"` when `values` reads MLP
    weights (the default says it reads only attention, norm, embedding and unembedding weights, which
    tests/app/test_lazy_weights.py checks). `qk_level`: the numbers are QK numbers at that level, and the answer
    says which form they are in (qk_forms.qk_form)."""
    view = create_model(
        "".join(w[0].upper() + w[1:] for w in title.split() if w.isalnum()) + "View",
        __base__=PerHeadView if qk_level is None else QKPerHeadView,
        __module__=PerHeadView.__module__,
        **{field: (list[list[float]], Field(description=f"[layer][head] {quantity}: {explanation}"))},  # type: ignore[call-overload]
    )

    def build(loaded: LoadedModel, p: NoParams, limits: Limits) -> PerHeadView:
        cfg = loaded.model.cfg
        numbers = values(loaded.model)  # [n_layers, n_heads]
        if tuple(numbers.shape) != (cfg.n_layers, cfg.n_heads):
            raise ValueError(f"{name}: {values.__qualname__} gave {tuple(numbers.shape)}, not [n_layers, n_heads]")
        answer = {field: numbers.tolist(), "d_head": cfg.d_head, "group_size": cfg.group_size}
        if qk_level is not None:
            answer |= qk_form_fields(loaded, qk_level)
        return view.model_validate({"model": model_ref(loaded), **answer})

    def priced(loaded: LoadedModel, p: NoParams, limits: Limits) -> Cost:
        return cost(loaded.model)

    return PerHeadAnalysis(
        name=name,
        path=name,
        params=NoParams,
        view=view,
        build=build,
        cost=priced,
        summary=summary,
        tags=list(tags),
        snippet=lambda p, v: snippets.per_head_body(values, field),
        needs_layers=1,
        weights=weights,
        page=PerHeadPage(values=field, title=title, explanation=explanation, quantity=quantity, digits=digits, nav=nav),
        values=values,
        field=field,
    )
