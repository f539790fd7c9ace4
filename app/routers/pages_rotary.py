"""Page parts of rotary models: the head page's positional kernel, band energies and QK eigenvalue
copying over δ (its eigenvalues at the page's offset), the pair page's δ profiles. Each runs the declared analysis
(app/views/rotary.py) through `call.run` (priced and cached like its API route) and draws its chart; the templates
include them only for rotary models."""

from __future__ import annotations

from typing import Any, Literal, TypedDict

from app import charts, snippets
from app.analysis import json_url
from app.charts import Figure
from app.routers.rendering import PageCall
from app.scheduling import cheap
from app.schemas.rotary import BandsView, CompositionProfileView, PositionalView, QKCopyingView
from app.views.rotary import (
    BANDS,
    POSITIONAL,
    PROFILE,
    QK_COPYING,
    BandsParams,
    PositionalParams,
    ProfileParams,
    QKCopyingParams,
)
from app.views.shared.basis import Basis
from app.views.shared.rotary_reference import is_rotary


def rotary_enabled(call: PageCall[Any]) -> bool:
    return call.model is not None and is_rotary(call.model)


class HeadRotary(TypedDict):
    """The head page's rotary panel: the positional kernel f(δ), the QK energy per rotary band, the QK eigenvalue
    copying over δ, each with its chart and its JSON twin."""

    positional: PositionalView
    bands: BandsView
    kernel_fig: Figure
    bands_fig: Figure
    positional_json: str
    bands_json: str
    qk_copying: QKCopyingView
    qk_copying_fig: Figure
    qk_eig_fig: Figure
    qk_copying_json: str


class HeadRotaryContext(TypedDict):
    rotary: HeadRotary | None  # None: not a rotary model


class PairRotary(TypedDict):
    """The composition pair page's rotary panel: the Q- and K-composition profiles over δ with the baseline."""

    profiles: dict[str, CompositionProfileView]  # "Q", "K"
    profile_fig: Figure
    snippet: str
    profile_json: dict[str, str]  # "Q", "K" -> the profile's JSON twin


class PairRotaryContext(TypedDict):
    rotary: PairRotary | None  # None: not a rotary model


async def head_rotary_context(call: PageCall[Any], head: str) -> HeadRotaryContext:
    """The positional kernel f(δ) and the energy per rotary band of one head, with their charts."""
    if not rotary_enabled(call):
        return {"rotary": None}
    model = call.model_id or ""
    b: Basis = getattr(call.params, "basis", "served")  # the page's weights (its basis picker)
    positional: PositionalView = await call.run(POSITIONAL, PositionalParams(head=head, basis=b))
    bands: BandsView = await call.run(BANDS, BandsParams(head=head, basis=b))
    qk_params = QKCopyingParams(
        head=head, offset=getattr(call.params, "offset", 0), basis=b
    )  # the head page's offset δ
    qk_copying: QKCopyingView = await call.run(QK_COPYING, qk_params)
    qk_fig = charts.lines(
        qk_copying.offsets,
        {"QK copying Σλ/Σ|λ|": qk_copying.scores},
        vlines=[qk_copying.offset],
        x_title="δ = query position − key position",
        y_title="eigenvalue copying score",
        title=f"QK eigenvalue copying of {head} over δ: {qk_copying.shape.summary}",
    )
    qk_eig = charts.complex_scatter(
        [(c.re, c.im) for c in qk_copying.eigenvalues],
        title=f"eigenvalues of W_E Ω(δ) W_Eᵀ / √d_head at δ = {qk_copying.offset} · {qk_copying.score:+.3f}",
    )
    kernel = charts.lines(
        positional.offsets,
        {"f(δ)": positional.kernel},
        x_title="δ = query position − key position",
        y_title="score (μ Ω(δ) μᵀ / √d_head)",
        vlines=[] if positional.shape.flat else [positional.peak_offset],
        title=f"positional kernel of {head}: {positional.shape.summary}",
    )
    energy = charts.bars(  # short tick labels (the band index): "k=0 (λ=6.28)" ran off the chart at 32 bands
        [str(k) for k in range(len(bands.wavelength))],
        bands.share,
        title=f"share of {head}'s QK energy per rotary band (band 0 fastest)",
        x_title="band k (hover: wavelength 2π/θ_k in positions)",
        y_title="share of ||Ω||² energy",
        customdata=[round(w, 4) for w in bands.wavelength],
        hover="band %{x}, wavelength %{customdata:.3g} positions<br>share %{y:.4f}",
    )
    return {
        "rotary": {
            "positional": positional,
            "bands": bands,
            "kernel_fig": kernel,
            "bands_fig": energy,
            "positional_json": json_url(POSITIONAL, model, PositionalParams(head=head, basis=b)),
            "bands_json": json_url(BANDS, model, BandsParams(head=head, basis=b)),
            "qk_copying": qk_copying,
            "qk_copying_fig": qk_fig,
            "qk_eig_fig": qk_eig,
            "qk_copying_json": json_url(QK_COPYING, model, qk_params),
        }
    }


async def pair_rotary_context(call: PageCall[Any], source: str, target: str) -> PairRotaryContext:
    """The pair's Q- and K-composition profiles over δ = 0..64, with the random baseline."""
    if not rotary_enabled(call):
        return {"rotary": None}
    model = call.model_id or ""
    b: Basis = getattr(call.params, "basis", "served")  # the page's weights (its basis picker)
    profiles: dict[str, CompositionProfileView] = {}
    kinds: tuple[Literal["Q", "K"], ...] = ("Q", "K")
    for kind in kinds:
        profiles[kind] = await call.run(PROFILE, ProfileParams(source=source, target=target, kind=kind, basis=b))
    first = profiles["K"]
    series: dict[str, list[float | None]] = {f"{k}-composition": list(v.scores) for k, v in profiles.items()}
    series["random baseline"] = [first.baseline] * len(first.offsets)
    fig = charts.lines(
        first.offsets,
        series,
        x_title="δ = query position − key position",
        y_title="composition score",
        title=f"{source} → {target}: Q and K composition over the offset δ",
    )
    entry = await cheap(call.registry.entry, model)
    snippet = snippets.composition_profile(
        entry.path, str(call.registry.dtype).removeprefix("torch."), source, target, "K", len(first.offsets)
    )
    return {
        "rotary": {
            "profiles": profiles,
            "profile_fig": fig,
            "snippet": snippet,
            "profile_json": {
                k: json_url(PROFILE, model, ProfileParams(source=source, target=target, kind=k, basis=b)) for k in kinds
            },
        }
    }
