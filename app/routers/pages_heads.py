"""The page of one head: its spectra, its circuit tables (OV, QK from both sides, skip-trigrams) on the chosen weights
and tokens, the heads it composes with, and the rotary and latent panels where they apply. A Page (rendering.py),
listed in app/routers/pages.py PAGES (the model's overview is pages_overview.py)."""

from __future__ import annotations

import asyncio
from typing import Any, Literal, TypedDict

from app import charts, snippets
from app.params import (
    DEFAULT_VOCAB,
    HeadParams,
    K,
    Offset,
    OVParams,
    QKParams,
    SkipTrigramParams,
)
from app.routers.pages_rotary import HeadRotary, HeadRotaryContext, head_rotary_context, rotary_enabled
from app.routers.rendering import (
    PageCall,
    attempt,
    is_fragment,
)
from app.scheduling import cheap
from app.schemas import CircuitTopView, HeadView, SkipTrigramView
from app.views.circuits import OV, QK
from app.views.composition import head_partners
from app.views.heads import HEAD
from app.views.latent import latent_head_panel
from app.views.shared.token_sets import has_token_counts
from app.views.skip_trigrams import SKIP_TRIGRAMS
from circuits_core.model.head_names import all_heads, head_name

POSITIONAL_SHOWN = 64  # first positions drawn in the positional QK heatmap (the JSON twin has them all)

# The page's "tokens" picker: every token, or those seen at least N times in training (the API's min_count).
MIN_COUNT_CHOICES = (50, 200, 500, 1000, 2000)


async def composition_partners(call: PageCall[Any], name: str, top: int = 6) -> list[dict[str, Any]]:
    """The heads this head composes with most (Q, K, V; score minus baseline): only the pairs naming it
    (views.composition.head_partners), not every pair of the model."""
    if call.loaded is None or call.loaded.model.cfg.n_layers < 2:
        return []
    loaded = call.loaded
    rows, _ = await attempt(
        head_partners, loaded, name, top, key=(loaded.path.name, loaded.digest, "partners", name, top)
    )
    return rows or []


def head_charts(view: HeadView) -> dict[str, Any]:
    figs: dict[str, Any] = {
        "ov_eig": charts.complex_scatter(
            [(c.re, c.im) for c in view.ov_eigenvalues],
            title=f"OV eigenvalues of W_E W_OV W_U · copying {view.scores.ov_copying:+.3f}"
            if view.scores.ov_copying is not None
            else "OV eigenvalues",
        ),
        "qk_eig": charts.complex_scatter(
            [(c.re, c.im) for c in view.qk_eigenvalues],
            title=f"QK eigenvalues of W_E W_QK W_E^T · {view.scores.qk_copying:+.3f}"
            if view.scores.qk_copying is not None
            else "QK eigenvalues",
        ),
        "svals": charts.grouped_bars(
            [str(i) for i in range(len(view.ov_singular_values))],
            {"W_OV": view.ov_singular_values, "W_QK": view.qk_singular_values},
            title="singular values of W_OV and W_QK",
            x_title="index",
        ),
    }
    if view.positional is not None:
        n = min(view.positional.n_positions, POSITIONAL_SHOWN)
        figs["positional"] = charts.heatmap(
            [row[:n] for row in view.positional.pattern[:n]],
            [str(i) for i in range(n)],
            [str(i) for i in range(n)],
            digits=3,
            title="softmax(W_pos W_QK W_pos^T / √d_head), causal",
            x_title="key position",
            y_title="query position",
            signed=False,
            zmax=1.0,
            hover="query %{y} → key %{x}<br>%{z:.3f}",
            colorbar="attention",
        )
    return figs


# -- a model's overview: its summary, the heads table and the paper's 2-D view of induction -------------------------
# -- one head: its spectra and its circuits ---------------------------------------------------------------------
class HeadPageParams(OVParams):
    k: K = 10
    offset: Offset = 0  # rotary models: the QK tables at this query-key offset


class HeadContext(TypedDict):
    """templates/head.html: one head's spectra (view) and its circuit tables (OV, QK from both sides, skip-trigrams)
    on the chosen weights and tokens, its composition partners, the rotary and latent panels where they apply, and
    the pickers' state."""

    head: str
    view: HeadView | None  # None on an htmx request for the circuits panel only
    ov: CircuitTopView
    ov_snippet: str
    qk_q: CircuitTopView
    qk_k: CircuitTopView | None  # the key side, when a token is given
    skip: SkipTrigramView
    token: str | None
    k: int
    figs: dict[str, Any]  # head_charts
    max_k: int
    partners: list[dict[str, Any]]  # composition_partners
    prev_head: str | None
    next_head: str | None
    base_url: str
    min_count: int | None
    has_counts: bool
    min_count_choices: tuple[int, ...]
    offset: int | None  # the QK tables' offset δ (None: 0)
    is_rotary: bool
    n_ctx: int
    vocab: Literal["all"] | None  # "all" only where it differs from the default
    n_vocab: int
    default_vocab: int
    rotary: HeadRotary | None
    latent: dict[str, Any] | None  # latent_head_panel


async def head_context(call: PageCall[HeadPageParams]) -> HeadContext:
    p = call.params
    cfg, name, model = call.model.model.cfg, p.head, call.model_id
    fragment_only = is_fragment(call.request) and call.request.headers.get("HX-Target") == "circuits"
    view: HeadView | None = None if fragment_only else await call.run(HEAD, HeadParams(head=name))
    b, v = p.basis, p.vocab  # every table of the circuits panel on the weights and token set chosen

    async def query_and_key() -> tuple[CircuitTopView | None, CircuitTopView]:
        qk_k = None
        if p.token is not None:  # first: the QK snippet offered is the query side's, run last
            qk_k = await call.run(
                QK,
                QKParams(
                    head=name, token=p.token, k=p.k, side="key", min_count=p.min_count, offset=p.offset, basis=b,
                    vocab=v,
                ),
            )  # fmt: skip
        qk_q: CircuitTopView = await call.run(
            QK,
            QKParams(
                head=name, token=p.token, k=p.k, side="query", min_count=p.min_count, offset=p.offset, basis=b, vocab=v
            ),
        )
        return qk_k, qk_q

    async def no_partners() -> list[dict[str, Any]]:
        return []

    async def no_rotary() -> HeadRotaryContext:
        return {"rotary": None}

    # The panels are independent once the view answered (a view still computing answers 202 before any of them
    # starts): asked at once, they take both compute slots when both are free, instead of one after the other. Each
    # is awaited to its end (answers are kept for the next visit), then the first failure, in the panels' order, is
    # the page's, as when they ran in turn.
    done = await asyncio.gather(
        call.run(OV, OVParams(head=name, token=p.token, k=p.k, min_count=p.min_count, basis=b, vocab=v)),
        query_and_key(),
        call.run(
            SKIP_TRIGRAMS,
            SkipTrigramParams(
                head=name, token=p.token, k=p.k, min_count=p.min_count, offset=p.offset, basis=b, vocab=v
            ),
        ),
        composition_partners(call, name) if view is not None else no_partners(),
        head_rotary_context(call, name) if view is not None else no_rotary(),
        return_exceptions=True,
    )
    for part in done:
        if isinstance(part, BaseException):
            raise part
    ov, (qk_k, qk_q), skip, partners, rotary = done
    entry = await cheap(call.registry.entry, model or "")
    ov_snippet = snippets.ov_table(
        entry.path,
        str(call.registry.dtype).removeprefix("torch."),
        name,
        ov.k,
        ov.token_ids,  # the token set the table ranked, as the view ranked it
        None if ov.token is None else ov.token.id,
        raw=p.basis == "raw",
    )
    every_head = [head_name(*pair) for pair in all_heads(cfg)]
    i = every_head.index(name)
    call.json_params = HeadParams(head=name)
    return {
        "head": name,
        "view": view,
        "ov": ov,
        "ov_snippet": ov_snippet,
        "qk_q": qk_q,
        "qk_k": qk_k,
        "skip": skip,
        "token": p.token,
        "k": p.k,
        "figs": head_charts(view) if view is not None else {},
        "max_k": call.limits.max_k,
        "partners": partners,
        "prev_head": every_head[i - 1] if i > 0 else None,
        "next_head": every_head[i + 1] if i + 1 < len(every_head) else None,
        "base_url": f"/models/{model}/heads/{name}",
        "min_count": p.min_count,
        "has_counts": has_token_counts(call.model),
        "min_count_choices": MIN_COUNT_CHOICES,
        "offset": p.offset or None,
        "is_rotary": rotary_enabled(call),
        "n_ctx": cfg.n_ctx,
        "vocab": p.vocab if p.vocab == "all" and cfg.d_vocab > DEFAULT_VOCAB else None,
        "n_vocab": cfg.d_vocab,
        "default_vocab": DEFAULT_VOCAB,
        "rotary": rotary["rotary"],
        "latent": latent_head_panel(call.model, name, view.latent) if view is not None else None,
    }
