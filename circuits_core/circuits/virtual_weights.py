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

All pairs at once: ||W_w W_r||_F^2 = <G_w, H_r>_F with G_w = W_w^T W_w and H_r = W_r W_r^T [d, d]. No Gram is
ever held whole: each is formed one column block at a time from its d_head- or d_mlp-sized factors (a head
writer's G = W_O^T (W_V^T W_V) W_O from the d_head Gram W_V^T W_V; an MLP's G = W_out^T W_out), the blocks of
all writers against the same blocks of all readers are one matmul, and only the upper block triangle is formed
(the Grams are symmetric; off-diagonal blocks count twice), as composition.py does. The vocabulary sides are
factors like the others: W_E_eff [d_vocab, d] (materialised once, the LN applied row by row) and W_U^T.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.composition import gram_block_size, random_baseline
from circuits_core.circuits.embedding import embed_eff
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.circuits.folded import layer_weights as stacked
from circuits_core.circuits.folded import mlp_output_weight
from circuits_core.circuits.stream_components import (
    SHARED,
    Reader,
    ReaderRole,
    Writer,
    chain_norm,
    experts,
    factored,
    has_pos_writer,
    mlp_input,
    mlp_output,
    mlp_roles,
    mlp_width,
    reaches,
    reader_chain,
    readers,
    rotation,
    writer_chain,
    writers,
)
from circuits_core.circuits.stream_flops import all_scores_flops, pair_flops
from circuits_core.circuits.stream_grams import GramSide, factors, inner_products
from circuits_core.cost import Cost, itemsize
from circuits_core.errors import InvalidInputError
from circuits_core.model.transformer import Transformer


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
    """AB = U diag(S) V^T restricted to the top k directions (S holds every singular value)."""

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
    return FactoredSVD(S, U, V)


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
    vals, idx = v.topk(min(n, v.shape[0]), largest=largest)
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


def neuron_logits(model: Transformer, layer: int, neuron: int) -> Tensor:
    """W_out[n] W_U [d_vocab]: the direct effect of MLP neuron n on every logit (a one-row virtual weight)."""
    return virtual_weight(model, Writer("mlp", layer, neurons=(neuron,)), Reader("unembed")).rows([0])[0]


def neuron_embed_reads(model: Transformer, layer: int, neuron: int, role: ReaderRole = "in") -> Tensor:
    """W_E_eff W_in[:, n] [d_vocab]: how much each token's embedding drives MLP neuron n (gated: role gate/up)."""
    return virtual_weight(model, Writer("embed"), Reader(role, layer, neurons=(neuron,))).cols([0])[0]


# -- every pair at once -------------------------------------------------------------------------------
def writer_groups(model: Transformer) -> list[tuple[list[Writer], GramSide]]:
    """The writers' Grams G_w = W_w^T W_w in the order of `writers` (embed, pos, then per layer heads and MLP)."""
    cfg, dt = model.cfg, model.compute_dtype
    # W_E_eff materialised [d_vocab, d] (LN rows); its Gram's blocks come from column slices like any factor
    groups = [([Writer("embed")], factors(embed_eff(model).to(dt)[None]))]
    if has_pos_writer(model):
        assert model.W_pos is not None
        groups.append(([Writer("pos")], factors(model.W_pos.to(dt)[None])))
    for layer in range(cfg.n_layers):
        W_V, W_O = (stacked(model, layer, name).to(dt) for name in ("W_V", "W_O"))  # [H, d, dh], [H, dh, d]
        heads = [Writer("head", layer, h) for h in range(cfg.n_heads)]
        groups.append((heads, factors(W_O, (W_V.transpose(-2, -1) @ W_V) @ W_O)))  # W_O^T (W_V^T W_V) W_O
        if not cfg.attn_only:
            W_out = mlp_output_weight(model, layer).to(dt)  # [d_mlp, d], or [n_experts, d_mlp, d]
            routed = [e for e in experts(model, layer) if e != SHARED]
            groups.append(
                ([Writer("mlp", layer, expert=e) for e in routed], factors(W_out.reshape(-1, *W_out.shape[-2:])))
            )
            if SHARED in experts(model, layer):  # DeepSeek's shared experts: a writer of their own
                shared = Writer("mlp", layer, expert=SHARED)
                groups.append(([shared], factors(mlp_output(model, shared).to(dt)[None])))
    return groups


def reader_groups(model: Transformer, offset: int = 0) -> list[tuple[list[Reader], GramSide]]:
    """The readers' Grams H_r = W_r W_r^T in the order of `readers` (per layer Q, K, V heads, MLP inputs; W_U)."""
    cfg, dt = model.cfg, model.compute_dtype
    groups: list[tuple[list[Reader], GramSide]] = []
    for layer in range(cfg.n_layers):
        R = rotation(model, offset, layer).to(dt)  # [dh, dh], the layer's own rope
        W_Q, W_K, W_V, W_O = (stacked(model, layer, n).to(dt) for n in ("W_Q", "W_K", "W_V", "W_O"))  # gains folded
        QQ, KK = W_Q.transpose(-2, -1) @ W_Q, W_K.transpose(-2, -1) @ W_K  # [H, dh, dh]
        # role -> (A, B B^T) of the reader A B: Q = W_Q (R W_K^T), K = W_K (R^T W_Q^T), V = W_V W_O
        parts = {"Q": (W_Q, R @ KK @ R.T), "K": (W_K, R.T @ QQ @ R), "V": (W_V, W_O @ W_O.transpose(-2, -1))}
        for role, (A, BBt) in parts.items():
            At = A.transpose(-2, -1)  # [H, dh, d]
            groups.append(([Reader(role, layer, h) for h in range(cfg.n_heads)], factors(At, BBt @ At)))  # type: ignore[arg-type]
        routed = [e for e in experts(model, layer) if e != SHARED]
        for role in mlp_roles(model):
            W = mlp_input(model, Reader(role, layer)).to(dt)  # [d, d_mlp] or [n_experts, d, d_mlp]
            W = W.reshape(-1, *W.shape[-2:]).transpose(-2, -1)  # [1 or n_experts, d_mlp, d]
            groups.append(([Reader(role, layer, expert=e) for e in routed], factors(W)))  # type: ignore[arg-type]
            if SHARED in experts(model, layer):
                shared = Reader(role, layer, expert=SHARED)  # type: ignore[arg-type]
                groups.append(([shared], factors(mlp_input(model, shared).to(dt).T[None])))
        if cfg.layer_has_experts(layer):
            groups.append(
                ([Reader("router", layer)], factors(mlp_input(model, Reader("router", layer)).to(dt).T[None]))
            )
    groups.append(([Reader("unembed")], factors(model.W_U.to(dt).T[None])))  # blocks are row slices of W_U
    return groups


@dataclass
class VirtualWeightScores:
    """Every writer x reader pair of a model (rows: `writers`, columns: `readers`, in those lists' order)."""

    writers: list[Writer]
    readers: list[Reader]
    raw: Tensor  # [Nw, Nr] ||W_w W_r|| / (||W_w|| ||W_r||), 0 where the reader does not see the writer
    minus_baseline: Tensor  # [Nw, Nr] raw - baseline where it reaches, 0 elsewhere
    mask: Tensor  # [Nw, Nr] bool: the reader sees the writer
    baseline: float  # composition.py's analytic 1/sqrt(d_model), the one subtracted
    sampled_baseline: float  # composition.random_baseline (ARENA's generator)
    sampled_std: float
    offset: int


def reach_mask(model: Transformer, ws: list[Writer], rs: list[Reader]) -> Tensor:
    """[Nw, Nr] bool on the model's device: stream_components.reaches for every pair, from the slots."""
    w_slot = torch.tensor([w.slot() for w in ws])
    r_slot = torch.tensor([r.slot(model) for r in rs])
    mask = w_slot[:, None] < r_slot[None, :]
    for i, w in enumerate(ws):
        if w.kind == "pos":  # shortformer positions reach only Q and K
            mask[i] = torch.tensor([reaches(model, w, r) for r in rs], dtype=torch.bool)
    return mask.to(model.device)


def all_scores(
    model: Transformer, offset: int = 0, should_stop: Callable[[], bool] | None = None
) -> VirtualWeightScores:
    """Scores of every writer x reader pair from blocked d x d Grams (see the module docstring)."""
    ws, rs = writers(model), readers(model)
    slots = [w.slot() for w in ws]  # non-decreasing
    limits = [sum(s < r.slot(model) for s in slots) for r in rs]  # writers written before the reader reads
    with torch.no_grad():
        wg, rg = writer_groups(model), reader_groups(model, offset)
        assert [w for g, _ in wg for w in g] == ws and [r for g, _ in rg for r in g] == rs
        num_sq, w_sq, r_sq = inner_products(
            [s for _, s in wg], [s for _, s in rg], should_stop, "virtual weight scores", limits
        )  # traces: ||W_w||^2, ||W_r||^2
        raw = num_sq.clamp_min(0).sqrt() / (w_sq[:, None].sqrt() * r_sq[None, :].sqrt())
    mask = reach_mask(model, ws, rs)
    raw = torch.where(mask, raw, torch.zeros_like(raw))
    baseline = analytic_baseline(model)
    sampled, std = random_baseline(model.cfg.d_model, model.cfg.d_head)
    minus = torch.where(mask, raw - baseline, torch.zeros_like(raw))
    return VirtualWeightScores(ws, rs, raw, minus, mask, baseline, sampled, std, offset)


def all_scores_cost(model: Transformer) -> Cost:
    """all_scores: the heads' d_head-sized factors (read in place: only the (W_V^T W_V) W_O-like products are new),
    W_E_eff, one block of every Gram and the [Nw, Nr] tables; answer: two tables plus the names."""
    cfg = model.cfg
    L, H, d, dh = cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head
    size = gram_block_size(d)
    n_mlp = 0  # hidden units of every MLP input (each expert's, shared ones, dense layers') and router columns
    for layer in range(0 if cfg.attn_only else L):
        n_mlp += sum(mlp_width(model, layer, e) for e in experts(model, layer))
        n_mlp += cfg.num_experts or 0 if cfg.layer_has_experts(layer) else 0
    roles = len(mlp_roles(model))
    Nw, Nr = len(writers(model)), len(readers(model))
    n_ctx = cfg.n_ctx if has_pos_writer(model) else 0
    factor_numbers = 4 * L * H * dh * d  # one layer's products at a time would do; all are kept
    dtype_copies = (
        0 if model.dtype == model.compute_dtype else (4 * L * H * dh * d + (1 + roles) * n_mlp * d + n_ctx * d)
    )
    numbers = factor_numbers + dtype_copies + cfg.d_vocab * d + 2 * (Nw + Nr) * size * size + 3 * Nw * Nr
    return Cost(numbers * itemsize(model.compute_dtype), flops=all_scores_flops(model)).with_answer(
        numbers=2 * Nw * Nr, labels=Nw + Nr
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
