"""A token circuit of heads, read without forming it: a chain of heads checked for increasing layers, its virtual OV
circuit W_E W_OV^{h1} ... W_OV^{hk} W_U as a factored matrix (docs/maths.md §2.10), and a token circuit's global
top-k entries and eigenvalue copying statistic. Shared by the composition pair view and the chain view."""

from __future__ import annotations

import torch

from app.schemas import Complex, MatrixEntry
from app.schemas.analyses import TokenCircuit
from app.settings import Limits
from app.views.shared.global_tables import top_token_entries
from app.views.shared.inputs import check_k, parse_heads, token_ref
from circuits_core.circuits import copying_spectra, embedding
from circuits_core.circuits import head_circuits as circuits
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.errors import InvalidInputError
from circuits_core.formats.checkpoint import LoadedModel
from circuits_core.model.head_names import head_name


def parse_chain(loaded: LoadedModel, heads: list[str], max_heads: int) -> list[tuple[int, int]]:
    """Head names of a chain -> [(layer, head)], checked: at most max_heads, layers strictly increasing."""
    chain = parse_heads(heads, loaded, max_heads)
    layers = [layer for layer, _ in chain]
    if any(a >= b for a, b in zip(layers, layers[1:], strict=False)):
        raise InvalidInputError(
            f"a chain of heads needs strictly increasing layers (each head reads what the previous one wrote); "
            f"got {', '.join(head_name(*c) for c in chain)} (layers {layers})"
        )
    return chain


def virtual_ov_circuit(
    loaded: LoadedModel, chain: list[tuple[int, int]], tokens: torch.Tensor | None = None
) -> FactoredMatrix:
    """W_E W_OV^{h1} ... W_OV^{hk} W_U [d_vocab, d_vocab], inner dimension d_head (docs/maths.md §2.10); with `tokens`
    (ids [n]) its [n, n] submatrix, formed on those tokens only."""
    model = loaded.model
    ov = circuits.ov_circuit(model, *chain[0])
    for layer, h in chain[1:]:
        ov = ov @ circuits.ov_circuit(model, layer, h)
    if tokens is None:
        return (embedding.embed_eff(model) @ ov) @ model.W_U
    return (embedding.embed_eff_rows(model, tokens) @ ov) @ model.W_U[:, tokens]


def token_circuit(
    loaded: LoadedModel,
    fm: FactoredMatrix,
    k: int,
    limits: Limits,
    labels: tuple[str, str],
    tokens: torch.Tensor | None = None,
) -> TokenCircuit:
    """Global top-k entries (streamed under the matrix budget) and the eigenvalue statistic of a token circuit; `tokens`
    (ids [n]): fm is the submatrix of those tokens (its eigenvalues are the submatrix's)."""
    k = check_k(k, limits, fm.ldim * fm.rdim)
    with torch.no_grad():
        values, rows, cols = top_token_entries(fm, k, limits.matrix_budget_bytes, tokens)  # [k] each
        eig = torch.linalg.eigvals(fm.BA.double())  # [d_head] complex
        copying = float(copying_spectra.copying_score(eig))
    entries = [
        MatrixEntry(row=token_ref(loaded, r), col=token_ref(loaded, c), value=float(v))
        for v, r, c in zip(values.tolist(), rows.tolist(), cols.tolist(), strict=True)
    ]
    return TokenCircuit(
        row_label=labels[0],
        col_label=labels[1],
        entries=entries,
        eigenvalues=[Complex(re=float(z.real), im=float(z.imag)) for z in eig.tolist()],
        copying=copying,
    )


VIRTUAL_LABELS = ("source token (attended to by the first head)", "output token (logit raised)")
