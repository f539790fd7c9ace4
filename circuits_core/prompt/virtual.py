"""Virtual attention heads: products of an earlier and a later head (V-composition).

Paper section: "Virtual Attention Heads" (Elhage et al. 2021; docs/maths.md §2.10). Row-vector convention, TL
order (earlier head first): for h1 in an earlier layer than h2,
    virtual OV   W_V^{h1} W_O^{h1} W_V^{h2} W_O^{h2}   [d_model, d_model], kept as FactoredMatrix
                 (W_V^{h1} [d, d_head], W_O^{h1} W_V^{h2} W_O^{h2} [d_head, d]): inner dimension d_head
    full virtual OV  W_E W_V^{h1} W_O^{h1} W_V^{h2} W_O^{h2} W_U; its copying score sum(eig)/sum(|eig|)
                 from lambda(W_O^{h1} W_V^{h2} W_O^{h2} G W_V^{h1}) with G = W_U W_E [d, d] (d_head x d_head)
    virtual pattern  A^{h2} A^{h1} [n, n] (row-stochastic, lower triangular)
Rankings: by V-composition score (composition.py) and by the order-2 term on a prompt (paths.py).
On a prompt, `chain_next_token_terms` gives a chain's path term (embedding, h1, ..., hk) on the logit of each
position's *actual* next token -- the paper's induction-head figure (its F23) -- rather than on one fixed token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from circuits_core.circuits.composition import composition_scores
from circuits_core.circuits.copying_spectra import copying_score, unembed_embed_gram
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.circuits.folded import head_weights, stacked_weights
from circuits_core.circuits.head_circuits import check_head
from circuits_core.circuits.host_linalg import eigvals
from circuits_core.cost import Cost, itemsize
from circuits_core.errors import CancelledError, InvalidInputError
from circuits_core.model.head_names import head_name
from circuits_core.model.transformer import Transformer
from circuits_core.prompt.frozen import (
    FrozenRun,
    attention,
    embed_source,
    ln_linear,
    post_gain,
    readout,
    target_cap_factors,
    value_inv_scale,
)
from circuits_core.prompt.path_sources import path_sources
from circuits_core.prompt.path_terms import PathExpansion

Head = tuple[int, int]


def _check_pair(model: Transformer, h1: Head, h2: Head) -> None:
    check_head(model, *h1)
    check_head(model, *h2)
    if h1[0] >= h2[0]:
        raise InvalidInputError(f"{head_name(*h1)} must be in an earlier layer than {head_name(*h2)}")


def virtual_ov(model: Transformer, h1: Head, h2: Head) -> FactoredMatrix:
    """W_V^{h1} W_O^{h1} W_V^{h2} W_O^{h2} [d_model, d_model] (inner d_head)."""
    _check_pair(model, h1, h2)
    (_, _, V1, O1), (_, _, V2, O2) = head_weights(model, *h1), head_weights(model, *h2)  # gains folded (folded.py)
    return FactoredMatrix(V1, (O1 @ V2) @ O2)


def factors_copying_score(left: Tensor, right: Tensor, G: Tensor) -> Tensor:
    """Copying score of W_E left right W_U from its factors: left [..., d, k], right [..., k, d], G = W_U W_E.

    Nonzero eigenvalues of the [V, V] circuit are those of right G left [..., k, k].
    """
    return copying_score(eigvals((right @ G @ left).double()))


def virtual_copying_scores(
    model: Transformer, G: Tensor | None = None, should_stop: Callable[[], bool] | None = None
) -> Tensor:
    """[L, H, L, H]: copying score of every full virtual OV circuit (h1 earlier, h2 later); 0 elsewhere."""
    cfg = model.cfg
    L, H = cfg.n_layers, cfg.n_heads
    G = unembed_embed_gram(model) if G is None else G  # [d, d]
    out = torch.zeros(L, H, L, H, dtype=torch.float64, device=model.device)
    W_V, W_O = stacked_weights(model, "W_V"), stacked_weights(model, "W_O")  # output-norm gains folded (folded.py)
    for l1 in range(L - 1):
        if should_stop is not None and should_stop():
            raise CancelledError("virtual copying scores cancelled")
        W_V1, W_O1 = W_V[l1], W_O[l1]  # [H, d, dh], [H, dh, d]
        OG2 = W_O[l1 + 1 :] @ G  # [L', H, dh, d]: W_O^{h2} G
        right = torch.einsum("hed,mgdf,mgfc->hmgec", W_O1, W_V[l1 + 1 :], OG2)  # [H, L', H, dh, d]
        out[l1, :, l1 + 1 :] = factors_copying_score(W_V1[:, None, None], right, torch.eye(cfg.d_model, dtype=G.dtype))
    return out


def virtual_pattern(run: FrozenRun, h1: Head, h2: Head) -> Tensor:
    """A^{h2} A^{h1} [n, n] from a clean run (frozen.frozen_run)."""
    if h1[0] >= h2[0]:
        raise InvalidInputError(f"{head_name(*h1)} must be in an earlier layer than {head_name(*h2)}")
    return run.patterns[h2[0], h2[1]] @ run.patterns[h1[0], h1[1]]


def rank_by_v_composition(model: Transformer, k: int = 20) -> list[tuple[str, str, float]]:
    """The k virtual heads (h1, h2, V-composition score minus baseline) with the largest score."""
    scores = composition_scores(model, kinds=("v",), n_samples=32).minus_baseline["v"]  # [L, H, L, H]
    H = model.cfg.n_heads
    flat = scores.flatten()
    idx = flat.argsort(descending=True, stable=True)[:k]  # equal scores: (h1, h2) in head order
    out = []
    for i in idx.tolist():
        l1, h1, l2, h2 = (
            i // (H * model.cfg.n_layers * H),
            (i // (model.cfg.n_layers * H)) % H,
            (i // H) % model.cfg.n_layers,
            i % H,
        )
        out.append((head_name(l1, h1), head_name(l2, h2), float(flat[i])))
    return out


def rank_by_contribution(
    expansion: PathExpansion, k: int = 20, position: int = 0
) -> list[tuple[tuple[str, ...], float]]:
    """The k order-2 embedding-sourced terms (virtual heads) of a path expansion with the largest |value|."""
    rows = [
        (p, float(v))
        for p, o, v in zip(
            expansion.paths, expansion.orders.tolist(), expansion.values[:, position].tolist(), strict=True
        )
        if o == 2 and not p[0].startswith(("bias:", "mlp:"))
    ]
    return sorted(rows, key=lambda r: -abs(r[1]))[:k]


def head_write(model: Transformer, run: FrozenRun, layer: int, h: int, X: Tensor) -> Tensor:
    """[n, d_model]: what head h of `layer` writes at each position when it reads X [n, d_model] (the stream through
    its frozen input norm): A^h X W_V^h W_O^h, and under an output norm (sandwich or output-only norms) times
    diag(gamma_post) / rho_post(i), the layer's frozen per-position output scale."""
    attn = attention(model, layer)
    Y = run.patterns[layer, h] @ (X @ attn.W_V[h] @ attn.W_O[h])  # [n, d]
    gamma = post_gain(model, layer)
    if gamma is None:
        return Y
    return Y * gamma * run.inv_scale(f"blocks.{layer}.ln1_post")[:, None]


def chain_terms(model: Transformer, run: FrozenRun, chain: list[Head], target: int) -> list[tuple[str, Tensor]]:
    """[(source, [n] values)]: the path term (source, h1, ..., hk) of the logit of `target` at every position, for the
    embedding ("embed") and each attention bias or MLP output entering before h1 (path_sources.path_sources), with the
    clean run's patterns and LayerNorm scales frozen. The same terms as paths.expand_logits lists for this chain,
    without expanding every other path of its order (C(L, k) H^k of them)."""
    _check_chain(model, chain)
    r = readout(model, target)[0]  # [d]: the centred, ln_final-weighted W_U column of the target
    n = run.n
    caps = run.inv_scale("ln_final").new_tensor(
        [target_cap_factors(run, target, p)[0] for p in range(n)]
    )  # [n]: the frozen logit cap factor at each position (ones without a cap)
    out = []
    for source in path_sources(model, run):
        if source.entry > chain[0][0]:
            continue  # written after h1 reads the stream
        Y = source.X.expand(n, -1)  # [n, d] (a bias: the same vector at every position)
        for layer, h in chain:
            X = ln_linear(model, f"blocks.{layer}.ln1", Y, value_inv_scale(model, run, layer))  # (MLA: / rho_kv)
            Y = head_write(model, run, layer, h, X)  # [n, d]
        out.append((source.name[0] if source.name else "embed", caps * run.inv_scale("ln_final") * (Y @ r)))
    return out


def chain_cost(model: Transformer, n: int, order: int, sources: int) -> Cost:
    """chain_terms on n tokens through `order` heads from `sources` sources (beside the frozen run): one [n, d_model]
    stream, its LayerNorm'd copy and the pattern product per step; FLOPs of the [n, n] x [n, d_model] and
    [n, d_model] x [d_model, d_head] products."""
    cfg = model.cfg
    d, dh = cfg.d_model, cfg.d_head
    flops = sources * order * (2 * n * d * dh * 2 + 2 * n * n * d) + 2 * n * n * n * order
    return Cost((3 * n * d + n * n) * itemsize(model.dtype), flops=flops)


def _check_chain(model: Transformer, chain: list[Head]) -> None:
    layers = [layer for layer, _ in chain]
    if not chain or layers != sorted(set(layers)):
        raise InvalidInputError(
            f"a chain needs heads in strictly increasing layers, got {[head_name(*c) for c in chain]}"
        )
    for layer, h in chain:
        check_head(model, layer, h)


def chain_next_token_terms(model: Transformer, run: FrozenRun, chain: list[Head]) -> Tensor:
    """[n - 1]: the path term (embedding, h1, ..., hk) of the logit of tokens[p + 1] at each position p.

    With the clean run's patterns and LayerNorm scales frozen (paths.py's bookkeeping), the chain carries
    Y = A^{hk} D ... A^{h1} D x_0 C diag(w) W_OV^{h1} ... C diag(w) W_OV^{hk}  [n, d_model]
    and its term on target t at p is inv_f[p] (Y[p] . r_t), r_t the centred, ln_final-weighted W_U column."""
    _check_chain(model, chain)
    Y = embed_source(model, run)  # [n, d]
    for layer, h in chain:
        X = ln_linear(model, f"blocks.{layer}.ln1", Y, value_inv_scale(model, run, layer))  # D (Y C) diag(w)
        Y = head_write(model, run, layer, h, X)  # [n, d]
    nxt = run.tokens[1:].tolist()
    R = torch.stack([readout(model, int(t))[0] for t in nxt]) if nxt else Y.new_zeros(0, Y.shape[1])  # [n-1, d]
    caps = Y.new_tensor([target_cap_factors(run, int(t), p)[0] for p, t in enumerate(nxt)])  # [n-1] logit caps
    return caps * run.inv_scale("ln_final")[:-1] * (Y[:-1] * R).sum(-1)
