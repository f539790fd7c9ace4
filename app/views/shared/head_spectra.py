"""Every head's full OV and QK eigenvalues from one pass over all heads, kept once per model in the result cache:
the head view and the copying metrics both read them."""

from __future__ import annotations

import torch
from pydantic import BaseModel

from app.scheduling import cached_build
from app.schemas import Complex
from circuits_core.circuits import copying_spectra
from circuits_core.formats.checkpoint import LoadedModel


class Spectra(BaseModel):
    """Every head's full OV and QK eigenvalues, each head's d_head sorted by |lambda| (flat [n_layers * n_heads *
    d_head], layer-major): both come from one pass over all heads, so they are computed once per model and kept in
    the result cache for every head view (on GPT-2 small ~4 s a pass, which each of 144 head views repeated)."""

    ov_re: list[float]
    ov_im: list[float]
    qk_re: list[float]
    qk_im: list[float]

    def head(self, which: str, index: int, d_head: int) -> list[Complex]:
        re, im = getattr(self, f"{which}_re"), getattr(self, f"{which}_im")
        part = slice(index * d_head, (index + 1) * d_head)
        return [Complex(re=a, im=b) for a, b in zip(re[part], im[part], strict=True)]


def _sorted(ov: torch.Tensor, qk: torch.Tensor) -> Spectra:
    """Spectra of eigenvalues [L, H, d_head] (complex), each head's sorted by |lambda|, descending."""
    ov, qk = (e.gather(-1, e.abs().sort(stable=True, dim=-1, descending=True).indices).flatten() for e in (ov, qk))
    return Spectra(ov_re=ov.real.tolist(), ov_im=ov.imag.tolist(), qk_re=qk.real.tolist(), qk_im=qk.imag.tolist())


def _key(loaded: LoadedModel) -> tuple[str, str]:
    return ("head-spectra", str(loaded.digest))


def spectra(loaded: LoadedModel) -> Spectra:
    """Every head's spectra: kept by the heads table that computed them (keep_spectra), else computed here and kept."""

    def build() -> Spectra:
        with torch.no_grad():
            return _sorted(copying_spectra.ov_eigenvalues(loaded.model), copying_spectra.qk_eigenvalues(loaded.model))

    return cached_build(_key(loaded), Spectra, build)


def keep_spectra(loaded: LoadedModel, ov: torch.Tensor, qk: torch.Tensor) -> None:
    """Keep the eigenvalues [L, H, d_head] another computation formed (the heads table's copying scores come from
    them), so no head view forms the Grams and solves the eigenproblems again."""
    cached_build(_key(loaded), Spectra, lambda: _sorted(ov, qk))
