"""Rotary-model analyses: a head's positional kernel, energy per rotary band and QK eigenvalue
copying over δ, a pair's Q/K composition profile over δ.

The kernel needs μ_l, the mean ln1 output entering each layer on a reference text: app/views/shared/rotary_reference.py,
which also holds the rotary checks the QK, composition and heads views share.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import torch
from pydantic import Field

from app import snippets
from app.analysis import Analysis, AnalysisParams, HeadField
from app.params import HEAD_DOC, BasisChoice, HeadParams, Offset
from app.schemas.common import Complex
from app.schemas.rotary import (
    BandsView,
    CompositionProfileView,
    PositionalView,
    ProfileShapeView,
    QKCopyingView,
)
from app.settings import Limits
from app.views.shared.basis import basis, raw_copy_cost, with_basis
from app.views.shared.inputs import model_ref, qk_form_fields
from app.views.shared.rotary_reference import check_offset, reference_forward_tokens, reference_means
from circuits_core.circuits import alibi_kernel, composition_rotary, rotary, rotary_bands, rotary_baseline
from circuits_core.circuits.copying_spectra import copying_score
from circuits_core.circuits.profile_shape import ProfileShape, profile_shape
from circuits_core.cost import Cost
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import head_name, parse_head
from circuits_core.model.window import last_attended

MaxOffset = Annotated[
    int,
    Field(
        ge=1,
        le=4096,
        description="offsets δ = 0..max_offset (clipped to n_ctx - 1, and to window - 1 on a sliding layer)",
    ),
]


def weights_basis(loaded: LoadedModel) -> str:
    """Which weights a rotary view's numbers come from (app.views.shared.basis), and what they leave out."""
    return f"{basis(loaded)}; biases not included"


# -- the positional kernel -----------------------------------------------------------------------------
class PositionalParams(HeadParams):
    max_offset: MaxOffset = rotary.KERNEL_WINDOW
    basis: BasisChoice = "served"


def _offsets(loaded: LoadedModel, max_offset: int, layer: int, alibi: bool = False) -> torch.Tensor:
    """δ = 0..max_offset, clipped to n_ctx - 1 (no query is further than that from its key) and, on a sliding `layer`,
    to window - 1 (the last offset it attends: the profile is not defined beyond); rotary models only (and ALiBi
    models where `alibi`)."""
    if not (alibi and loaded.model.cfg.alibi is not None):
        rotary.check_rotary(loaded.model)
    return torch.arange(last_attended(loaded.model.cfg, layer, min(max_offset, loaded.model.cfg.n_ctx - 1)) + 1)


def _shape(loaded: LoadedModel, values: list[float], offsets: torch.Tensor, layer: int) -> ProfileShape:
    """The reading of a profile over `offsets` on `layer`; its far end is open unless it is the last offset the layer
    attends (the model's last position, or on a sliding layer its window's last offset, where a maximum is an
    edge)."""
    offs = offsets.tolist()
    end = last_attended(loaded.model.cfg, layer, loaded.model.cfg.n_ctx - 1)
    return profile_shape(values, offs, open_end=offs[-1] < end, window=loaded.model.cfg.layer_window(layer))


def build_positional_view(loaded: LoadedModel, p: PositionalParams, limits: Limits) -> PositionalView:
    """f_h(δ) = μ_l Ω_h(δ) μ_l^T / s for δ = 0..max_offset, and where it peaks; ALiBi: the constant content part
    minus m_h δ (alibi_kernel.py)."""
    loaded = with_basis(loaded, p.basis)
    layer, h = parse_head(p.head, loaded.model.cfg)
    offsets = _offsets(loaded, p.max_offset, layer, alibi=True)
    mu, ref = reference_means(loaded)
    alibi = loaded.model.cfg.alibi is not None
    kernel_of = alibi_kernel.positional_kernel if alibi else rotary.positional_kernel
    kernel = kernel_of(loaded.model, mu, offsets)[layer, h]  # [n]
    return PositionalView(
        model=model_ref(loaded),
        **qk_form_fields(loaded, "token"),  # the score of a query and a key both μ_l, with μ_l's own scales
        head=head_name(layer, h),
        offsets=offsets.tolist(),
        kernel=kernel.tolist(),
        peak_offset=int(offsets[int(kernel.argmax())]),
        shape=ProfileShapeView.of(_shape(loaded, kernel.tolist(), offsets, layer), "peak"),
        reference=ref,
        basis=f"{weights_basis(loaded)}; μ_l = mean ln1 output entering layer {layer} on the reference text, first "
        f"token left out"
        + ("; ALiBi: a constant content part minus the head's slope times δ, exactly linear" if alibi else ""),
    )


def positional_cost(loaded: LoadedModel, p: PositionalParams, limits: Limits) -> Cost:
    return rotary.kernel_cost(loaded.model, p.max_offset + 1, reference_forward_tokens(loaded)) + raw_copy_cost(
        loaded, p.basis
    )


POSITIONAL = Analysis(
    name="positional",
    path="heads/{head}/positional",
    params=PositionalParams,
    view=PositionalView,
    build=build_positional_view,
    cost=positional_cost,
    tags=["rotary"],
    summary="Positional kernel f(δ) = μ Ω(δ) μᵀ / √d_head of a rotary head",
    snippet=snippets.positional_body,
)


# -- energy per rotary band ----------------------------------------------------------------------------
class BandsParams(HeadParams):
    basis: BasisChoice = "served"


def build_bands_view(loaded: LoadedModel, p: BandsParams, limits: Limits) -> BandsView:
    loaded = with_basis(loaded, p.basis)
    layer, h = parse_head(p.head, loaded.model.cfg)
    with torch.no_grad():
        bands = rotary_bands.band_energies(loaded.model)
    energy = bands.energy[layer, h]  # [K]
    total = float(energy.sum() + bands.unrotated[layer, h])
    return BandsView(
        model=model_ref(loaded),
        **qk_form_fields(loaded, "weight"),
        head=head_name(layer, h),
        theta=bands.theta[layer].tolist(),  # the head's own layer's rope (local and global layers differ)
        wavelength=bands.wavelength[layer].tolist(),
        cos_part=bands.cos_part[layer, h].tolist(),
        sin_part=bands.sin_part[layer, h].tolist(),
        energy=energy.tolist(),
        unrotated=float(bands.unrotated[layer, h]),
        share=(energy / total if total > 0 else energy).tolist(),
        basis=weights_basis(loaded),
    )


def bands_cost(loaded: LoadedModel, p: BandsParams, limits: Limits) -> Cost:
    return rotary_bands.bands_cost(loaded.model) + raw_copy_cost(loaded, p.basis)


BANDS = Analysis(
    name="rotary-bands",
    weights="attention",
    path="heads/{head}/bands",
    params=BandsParams,
    view=BandsView,
    build=build_bands_view,
    cost=bands_cost,
    tags=["rotary"],
    summary="QK energy of a rotary head per frequency band",
    snippet=snippets.rotary_bands_body,
)


# -- composition profile over δ ------------------------------------------------------------------------
class ProfileParams(AnalysisParams):
    source: Annotated[str, Field(max_length=16, description=f"the earlier {HEAD_DOC}"), HeadField()]
    target: Annotated[str, Field(max_length=16, description=f"the later {HEAD_DOC}"), HeadField()]
    kind: Annotated[Literal["Q", "K"], Field(description="Q or K composition")] = "K"
    max_offset: MaxOffset = rotary.KERNEL_WINDOW
    basis: BasisChoice = "served"


def build_profile_view(loaded: LoadedModel, p: ProfileParams, limits: Limits) -> CompositionProfileView:
    """C_Q(δ) or C_K(δ) = ||W_OV^A Ω_B(δ)^(T)|| / (||W_OV^A|| ||Ω_B(δ)||) for δ = 0..max_offset."""
    loaded = with_basis(loaded, p.basis)
    model = loaded.model
    target = parse_head(p.target, model.cfg)[0]  # the layer whose window bounds the offsets
    offsets = _offsets(loaded, p.max_offset, target)
    scores = composition_rotary.pair_profile(model, p.source, p.target, p.kind.lower(), offsets)  # [n]
    cfg = model.cfg
    mean, std = composition_rotary.random_baseline(cfg.d_model, cfg.d_head, cfg.group_size)
    i = int(scores.argmax())
    return CompositionProfileView(
        model=model_ref(loaded),
        **qk_form_fields(loaded, "weight"),
        source=p.source,
        target=p.target,
        kind=p.kind,
        offsets=offsets.tolist(),
        scores=scores.tolist(),
        baseline=mean,
        baseline_std=std,
        peak=float(scores[i]),
        peak_offset=int(offsets[i]),
        shape=ProfileShapeView.of(_shape(loaded, scores.tolist(), offsets, target), "peak"),
        basis=weights_basis(loaded),
    )


def profile_cost(loaded: LoadedModel, p: ProfileParams, limits: Limits) -> Cost:
    """The pair's profile, then the sampled baseline beside it (rotary_baseline, cached after its first call)."""
    cfg = loaded.model.cfg
    baseline = rotary_baseline.baseline_cost(cfg.d_model, cfg.d_head, cfg.group_size, rotary_baseline.BASELINE_DRAWS)
    profile = composition_rotary.pair_profile_cost(loaded.model, min(p.max_offset, cfg.n_ctx - 1) + 1)
    return profile.then(baseline) + raw_copy_cost(loaded, p.basis)


PROFILE = Analysis(
    name="composition-profile",
    weights="attention",
    path="composition/{source}/{target}/profile",
    params=ProfileParams,
    view=CompositionProfileView,
    build=build_profile_view,
    cost=profile_cost,
    tags=["rotary", "composition"],
    summary="Q- or K-composition of one pair as a function of the query-key offset δ",
)


# -- QK eigenvalue copying at an offset ---------------------------------------------------------------------
class QKCopyingParams(HeadParams):
    offset: Offset = 0
    max_offset: MaxOffset = rotary.KERNEL_WINDOW
    basis: BasisChoice = "served"


def build_qk_copying_view(loaded: LoadedModel, p: QKCopyingParams, limits: Limits) -> QKCopyingView:
    """Σλ / Σ|λ| of W_E_eff Ω_h(δ) W_E_eff^T / s for δ = 0..max_offset, and its eigenvalues at δ = offset."""
    loaded = with_basis(loaded, p.basis)
    model = loaded.model
    layer, h = parse_head(p.head, model.cfg)
    offsets = _offsets(loaded, p.max_offset, layer)
    check_offset(loaded, p.offset, layer)
    with torch.no_grad():
        eig = rotary.head_qk_eigenvalues_at(
            model, layer, h, torch.cat([offsets, torch.tensor([p.offset])])
        )  # [n + 1, dh]
    scores = copying_score(eig[:-1])  # [n]
    return QKCopyingView(
        model=model_ref(loaded),
        **qk_form_fields(loaded, "weight"),
        head=head_name(layer, h),
        offset=p.offset,
        eigenvalues=[Complex(re=float(z.real), im=float(z.imag)) for z in eig[-1]],
        score=float(copying_score(eig[-1])),
        offsets=offsets.tolist(),
        scores=scores.tolist(),
        peak_offset=int(offsets[int(scores.argmax())]),
        shape=ProfileShapeView.of(_shape(loaded, scores.tolist(), offsets, layer), "largest"),
        basis=f"{weights_basis(loaded)}; tokens as W_E with layer 0's norm applied to each row (W_E_eff), positions by "
        f"R(δ) only",
    )


def qk_copying_cost(loaded: LoadedModel, p: QKCopyingParams, limits: Limits) -> Cost:
    rotary.check_rotary(loaded.model)  # refused for its positions, then its offset, before it is priced
    check_offset(loaded, p.offset, parse_head(p.head, loaded.model.cfg)[0])
    return rotary.qk_copying_at_cost(loaded.model, min(p.max_offset, loaded.model.cfg.n_ctx - 1) + 2) + raw_copy_cost(
        loaded, p.basis
    )


QK_COPYING = Analysis(
    name="qk-copying-offset",
    weights="attention",
    path="heads/{head}/qk-copying",
    params=QKCopyingParams,
    view=QKCopyingView,
    build=build_qk_copying_view,
    cost=qk_copying_cost,
    tags=["rotary"],
    summary="QK eigenvalue copying of a rotary head's full QK circuit at each query-key offset δ",
    snippet=snippets.qk_copying_offset_body,
)

ANALYSES: list[Analysis[Any, Any]] = [POSITIONAL, BANDS, PROFILE, QK_COPYING]
