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


def spectra(loaded: LoadedModel) -> Spectra:
    def build() -> Spectra:
        with torch.no_grad():
            ov, qk = (
                copying_spectra.ov_eigenvalues(loaded.model),
                copying_spectra.qk_eigenvalues(loaded.model),
            )  # [L, H, d_head] complex
        ov, qk = (e.gather(-1, e.abs().sort(stable=True, dim=-1, descending=True).indices).flatten() for e in (ov, qk))
        return Spectra(ov_re=ov.real.tolist(), ov_im=ov.imag.tolist(), qk_re=qk.real.tolist(), qk_im=qk.imag.tolist())

    return cached_build(("head-spectra", str(loaded.digest)), Spectra, build)
