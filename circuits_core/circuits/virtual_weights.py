"""Virtual weights: what every reader of the residual stream reads of what every writer wrote into it.

Paper section: "Virtual Weights and the Residual Stream as a Communication Channel" (Elhage et al. 2021;
docs/maths.md §2.1, §2.9). Row-vector (TransformerLens) convention, x @ W. Writers W_w [n_in, d_model] (embed, pos,
heads' W_OV, MLPs' W_out) and readers W_r [d_model, n_out] (heads' W_QK, W_QK^T, W_OV, MLP inputs, W_U) are
listed in stream_components.py.

The virtual weight of a pair is W_w W_r [n_in, n_out] (the paper's W_I^{l2} W_O^{l1} with each side's own other
factor kept), a FactoredMatrix through the smallest inner dimension. Its score ||W_w W_r||_F / (||W_w||_F
||W_r||_F) is in [0, 1]; head -> head Q/K/V scores are composition.py's Q/K/V composition scores. Rotary Q/K
readers are read at query-key offset 0 unless an offset is chosen.

Random baseline (composition.py's): for a random side whose row space is rotation invariant,
E||W_w W_r||^2 = ||W_w||^2 ||W_r||^2 / d_model whatever the ranks, so the expected score is about
1/sqrt(d_model) (composition.random_baseline samples it with ARENA's generator).

The norm between layers is ignored, as the paper does: the weights are used as loaded (with LN folded by the
default processing, its weight and centring are inside them), the per-token LN/RMS scale is not.

Every pair at once, from blocked Grams: virtual_weight_table.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.composition import random_baseline
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.circuits.stream_chains import chain_norm, factored, reader_chain, writer_chain
from circuits_core.circuits.stream_components import Reader, Writer, mlp_width, reaches
from circuits_core.circuits.stream_flops import pair_flops
from circuits_core.cost import Cost, itemsize
from circuits_core.errors import InvalidInputError
from circuits_core.model.transformer import Transformer
from circuits_core.ranking import top_k


def virtual_weight(model: Transformer, writer: Writer, reader: Reader, offset: int = 0) -> FactoredMatrix:
    """W_w W_r [n_in, n_out]: what `reader` reads of what `writer` wrote, through the smallest inner dimension."""
    if not reaches(model, writer, reader):
        raise InvalidInputError(
            f"{reader.name} does not read what {writer.name} writes (it reads earlier or not at all)"
        )
    if offset != 0 and reader.role not in ("Q", "K"):
        raise InvalidInputError(
            f"offset {offset}: only Q and K readers are read at a query-key offset (rotary models); "
            f"{reader.name} is not rotated, so ask for it at offset 0"
        )
    return factored(model, writer_chain(model, writer) + reader_chain(model, reader, offset))


def analytic_baseline(model: Transformer) -> float:
    """composition.py's subtracted baseline, 1/sqrt(d_model) (CompositionScores.baseline)."""
    return 1.0 / math.sqrt(model.cfg.d_model)


# -- one pair: score, singular values, directions ------------------------------------------------------
@dataclass
class FactoredSVD:
    """AB = U diag(S) V^T restricted to the top k directions (S holds every singular value); each U_i's entry of
    largest magnitude is positive (docs/maths.md §1.8)."""

    S: Tensor  # [r], descending
    U: Tensor  # [ldim, k]
    V: Tensor  # [rdim, k]


GRAM_ROWS = 4096  # rows of a factor upcast to float64 at a time when forming its Gram


def gram64(X: Tensor) -> Tensor:
    """X^T X [c, c] in float64 for X [n, c], formed GRAM_ROWS rows at a time (no float64 copy of X)."""
    G = torch.zeros(X.shape[1], X.shape[1], dtype=torch.float64, device=X.device)
    for i in range(0, X.shape[0], GRAM_ROWS):
        chunk = X[i : i + GRAM_ROWS].double()
        G.addmm_(chunk.T, chunk)
    return G


def factored_svd(fm: FactoredMatrix, k: int) -> FactoredSVD:
    """SVD of A B (A [n, r], B [r, m]) through the r x r Grams: O((n + m) r^2), never an n x m or n x r SVD.

    A^T A = E_a diag(a^2) E_a^T and B B^T = E_b diag(b^2) E_b^T give A = Q_a diag(a) E_a^T and
    B = E_b diag(b) Q_b^T with orthonormal Q_a, Q_b, so A B = Q_a C Q_b^T with the r x r core
    C = diag(a) E_a^T E_b diag(b); its SVD C = U_c S V_c^T gives U = A E_a diag(1/a) U_c, V = B^T E_b diag(1/b) V_c.
    Squaring costs precision: an eigenvalue of a Gram is known to about r eps a_max^2, so a singular value to about
    sqrt(r eps) s_max. The Grams, their eigenvectors and the core are therefore float64 whatever the weights' dtype
    (the products of float32 or half-precision entries are exact in float64), and only values below
    sqrt(r eps_64) s_max (about 4e-7 s_max for r = 576) are reported as 0. S is float64; U and V are in A's dtype.
    """
    A, B = fm.A, fm.B
    r = A.shape[1]
    ea, Ea = torch.linalg.eigh(gram64(A))
    eb, Eb = torch.linalg.eigh(gram64(B.T))
    a, b = ea.clamp_min(0).sqrt(), eb.clamp_min(0).sqrt()
    core = (a[:, None] * Ea.T) @ (Eb * b[None, :])  # [r, r] float64
    Uc, S, Vch = torch.linalg.svd(core)
    noise = (r * torch.finfo(torch.float64).eps) ** 0.5
    S = torch.where(S > S[0] * noise, S, torch.zeros_like(S))
    k = min(k, S.shape[0])
    inv_a = torch.where(a > a.max() * noise, 1 / a.clamp_min(torch.finfo(a.dtype).tiny), torch.zeros_like(a))
    inv_b = torch.where(b > b.max() * noise, 1 / b.clamp_min(torch.finfo(b.dtype).tiny), torch.zeros_like(b))
    dt = A.dtype if A.dtype in (torch.float32, torch.float64) else torch.float32
    U = A.to(dt) @ (Ea @ (inv_a[:, None] * Uc[:, :k])).to(dt)
    V = B.T.to(dt) @ (Eb @ (inv_b[:, None] * Vch[:k].T)).to(dt)
    return FactoredSVD(S, *_signed(U, V))


def _signed(U: Tensor, V: Tensor) -> tuple[Tensor, Tensor]:
    """U [ldim, k], V [rdim, k] with each pair of columns (U_i, V_i) times the one sign that makes U_i's entry of
    largest magnitude positive (argmax: the first of equal magnitudes), whatever sign the backend's SVD gave them
    (docs/maths.md §1.8)."""
    peak = U.abs().argmax(0, keepdim=True)  # [1, k]
    sign = torch.where(U.gather(0, peak) < 0, -1.0, 1.0).to(U.dtype)  # [1, k]
    return U.mul_(sign), V.mul_(sign)


@dataclass
class Direction:
    """One singular direction: its value and, on a side indexed by tokens/positions/neurons, the extremes."""

    value: float
    input_top: list[tuple[int, float]] | None  # (index, entry) largest entries of U[:, i] (None: d_model side)
    input_bottom: list[tuple[int, float]] | None
    output_top: list[tuple[int, float]] | None
    output_bottom: list[tuple[int, float]] | None
    # a d_model side read in tokens (token_reading): (token id, value) largest and smallest
    input_tokens_top: list[tuple[int, float]] | None = None
    input_tokens_bottom: list[tuple[int, float]] | None = None
    output_tokens_top: list[tuple[int, float]] | None = None
    output_tokens_bottom: list[tuple[int, float]] | None = None


@dataclass
class VirtualWeightReport:
    writer: str
    reader: str
    input_space: str  # what indexes the virtual weight's rows: tokens, positions, neurons or d_model
    output_space: str  # columns: tokens (logits), neurons or d_model
    score: float
    baseline: float  # composition.py's analytic 1/sqrt(d_model), the one subtracted
    sampled_baseline: float  # composition.random_baseline mean (ARENA's generator, d_head-rank factors)
    singular_values: list[float]
    directions: list[Direction]  # top singular directions; (U_i, V_i) defined up to a common sign
    offset: int
    input_read: str | None = None  # how a d_model input side is read in tokens: "W_E" (None: not a d_model side)
    output_read: str | None = None  # "W_E" (a Q/K reader's other side) or "W_U" (a V reader's output)


def _space(kind: str) -> str:
    return {
        "embed": "tokens",
        "pos": "positions",
        "mlp": "neurons",
        "unembed": "tokens",
        "in": "neurons",
        "router": "experts",
        "gate": "neurons",
        "up": "neurons",
    }.get(kind, "d_model")


def _extremes(v: Tensor, n: int, space: str, largest: bool) -> list[tuple[int, float]] | None:
    if space == "d_model":
        return None
    vals, idx = top_k(v, min(n, v.shape[0]), largest)  # equal entries: the lower index first
    return [(int(i), float(x)) for i, x in zip(idx.tolist(), vals.tolist(), strict=True)]


# How a d_model side of a virtual weight reads in tokens (no norm applied: a direct-path reading). The writer
# head's input side, and a Q/K reader's other side, are directions tokens are embedded along (W_E u: which
# tokens, embedded, point along u); a V reader's output side is written to the stream (v W_U: whose logits it
# raises).
READ_THROUGH = {"input": "W_E", "Q": "W_E", "K": "W_E", "V": "W_U"}


def token_reading(model: Transformer, direction: Tensor, through: str) -> Tensor:
    """[d_vocab]: a d_model direction [d_model] read in tokens, W_E u ("W_E") or u W_U ("W_U")."""
    d = direction.to(model.W_E.dtype)
    return model.W_E @ d if through == "W_E" else d @ model.W_U


def _neuron_ids(neurons: tuple[int, ...] | None, idx: list[tuple[int, float]] | None) -> list[tuple[int, float]] | None:
    if idx is None or neurons is None:
        return idx
    return [(neurons[i], x) for i, x in idx]


def pair_report(
    model: Transformer, writer: Writer, reader: Reader, k: int = 5, n_top: int = 10, offset: int = 0
) -> VirtualWeightReport:
    """Score, baseline, every singular value and the top-k singular directions of one virtual weight."""
    with torch.no_grad():
        fm = virtual_weight(model, writer, reader, offset)
        svd = factored_svd(fm, k)
        w_norm = chain_norm(model, writer_chain(model, writer))
        r_norm = chain_norm(model, reader_chain(model, reader, offset))
    score = float(svd.S.pow(2).sum().sqrt() / (w_norm * r_norm))
    ins, outs = _space(writer.kind), _space(reader.role)
    in_read = READ_THROUGH["input"] if ins == "d_model" else None
    out_read = READ_THROUGH.get(reader.role) if outs == "d_model" else None
    dirs = []
    for i in range(svd.U.shape[1]):
        u, v = svd.U[:, i], svd.V[:, i]
        d = Direction(
            float(svd.S[i]),
            _neuron_ids(writer.neurons, _extremes(u, n_top, ins, True)),
            _neuron_ids(writer.neurons, _extremes(u, n_top, ins, False)),
            _neuron_ids(reader.neurons, _extremes(v, n_top, outs, True)),
            _neuron_ids(reader.neurons, _extremes(v, n_top, outs, False)),
        )
        with torch.no_grad():
            if in_read is not None:
                t = token_reading(model, u, in_read)
                d.input_tokens_top, d.input_tokens_bottom = (_extremes(t, n_top, "tokens", b) for b in (True, False))
            if out_read is not None:
                t = token_reading(model, v, out_read)
                d.output_tokens_top, d.output_tokens_bottom = (_extremes(t, n_top, "tokens", b) for b in (True, False))
        dirs.append(d)
    sampled, _ = random_baseline(model.cfg.d_model, model.cfg.d_head)
    return VirtualWeightReport(
        writer.name,
        reader.name,
        ins,
        outs,
        score,
        analytic_baseline(model),
        sampled,
        svd.S.tolist(),
        dirs,
        offset,
        in_read,
        out_read,
    )


def pair_cost(model: Transformer, writer: Writer, reader: Reader, k: int, n_top: int, offset: int = 0) -> Cost:
    """pair_report: the two factors of the virtual weight (the outer sides at most d_vocab x d_model), their r x r
    Grams, eigenvectors and core SVD, k directions on each side; answer: every singular value and 4 k n_top entries;
    FLOPs: stream_flops.pair_flops."""
    cfg = model.cfg
    sizes = {
        "embed": cfg.d_vocab,
        "pos": cfg.n_ctx,
        "mlp": len(writer.neurons or ()) or mlp_width(model, max(writer.layer, 0), writer.expert),
        "unembed": cfg.d_vocab,
        **dict.fromkeys(
            ("in", "gate", "up"), len(reader.neurons or ()) or mlp_width(model, max(reader.layer, 0), reader.expert)
        ),
        "router": cfg.num_experts or 0,
    }
    n_in = sizes.get(writer.kind, cfg.d_model)
    n_out = sizes.get(reader.role, cfg.d_model)
    r = cfg.d_head if writer.kind == "head" or reader.role in ("Q", "K", "V") else cfg.d_model
    numbers = (n_in + n_out) * (r + k) + 8 * r * r + (n_in * cfg.d_model if writer.kind == "embed" else 0)
    token_sides = int(_space(writer.kind) == "d_model") + int(
        _space(reader.role) == "d_model" and reader.role in READ_THROUGH
    )  # the sides pair_report reads in tokens
    flops = pair_flops(model, writer, reader, k, token_sides, offset)
    return Cost(numbers * itemsize(model.compute_dtype), flops=flops).with_answer(
        numbers=r + 4 * k * n_top, labels=4 * k * n_top
    )
