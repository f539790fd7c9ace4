"""Global top-k tables of a full circuit, shared by the views that read them (the OV, QK and direct tables, the
skip-trigrams' default source): each is computed once per (circuit, head, weights, offset, token set) at
k = max(k, SHARED_K) and kept in the result cache (`global_top`), so the head page's k=10 tables, the API's k=20
defaults and the skip-trigram default source (the OV table's first row) all read the same one; `search_cost` prices
it.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel
from torch import Tensor

from app.params import DirectParams
from app.scheduling import cached_build
from app.settings import Limits
from app.views.shared.basis import basis
from app.views.shared.token_sets import TokenSet, token_set
from circuits_core.circuits import head_circuits as circuits
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.cost import Cost
from circuits_core.formats.checkpoint import LoadedModel

SHARED_K = 20  # the largest k the app asks a global table for by default: the API's 20 (head page 10, skip source 1)


class GlobalTop(BaseModel):
    """A global top-k table, kept in the result cache for every request that reads a prefix of it."""

    values: list[float]
    rows: list[int]
    cols: list[int]


CircuitOf = Callable[[Tensor | None], FactoredMatrix]  # token ids [n] (None: all) -> the circuit's [n, n] submatrix


def global_top(
    loaded: LoadedModel, circuit_of: CircuitOf, table: tuple[str, ...], k: int, tokens: TokenSet, limits: Limits
) -> GlobalTop:
    """The k largest entries of the circuit among tokens x tokens: the first k of one shared top-max(k, SHARED_K)
    table, cached under (model digest, weights, `table` = circuit, head, offset, token set, its k). The circuit is
    built on the token set only (circuit_of(ids)), so a large vocabulary's whole factors are never formed."""
    shared = max(k, min(SHARED_K, tokens.n**2))
    key = ("global-top", str(loaded.digest), basis(loaded), *table, tokens.name, str(shared))

    def build() -> GlobalTop:
        values, rows, cols = top_token_entries(circuit_of(tokens.ids), shared, limits.matrix_budget_bytes, tokens.ids)
        return GlobalTop(values=values.tolist(), rows=rows.tolist(), cols=cols.tolist())

    top = cached_build(key, GlobalTop, build)
    return GlobalTop(values=top.values[:k], rows=top.rows[:k], cols=top.cols[:k])


def top_token_entries(
    fm: FactoredMatrix, k: int, budget_bytes: int, ids: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """(values, rows, cols) [k] of fm's k largest entries, streamed under budget_bytes; with `ids` (token ids [n], on
    the host) fm is the [n, n] submatrix of those tokens, and the positions the search found (on the model's device)
    are read as token ids on the host."""
    values, rows, cols = fm.topk_global(k, budget_bytes=budget_bytes)  # [k] each
    if ids is not None:
        rows, cols = ids[rows.cpu()], ids[cols.cpu()]
    return values, rows, cols


def search_cost(loaded: LoadedModel, p: DirectParams, limits: Limits, circuit: circuits.Circuit = "ov") -> Cost:
    """The global table a request without a token reads: top max(k, SHARED_K) among its token set."""
    ranked = token_set(loaded, p.min_count, p.vocab)
    return circuits.top_cost(
        loaded.model,
        max(p.k, min(SHARED_K, ranked.n**2)),
        limits.matrix_budget_bytes,
        line=False,
        n_tokens=None if ranked.ids is None else ranked.n,
        circuit=circuit,
    )
