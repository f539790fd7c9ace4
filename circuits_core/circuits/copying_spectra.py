"""The eigenvalue copying analysis of every head, through d_head x d_head matrices and two d_model x d_model Grams.

Paper section (Elhage et al. 2021): "Summarizing OV/QK matrices", copying and the eigenvalue analysis. The nonzero
eigenvalues of AB equal those of BA, so each [d_vocab, d_vocab] full circuit's spectrum comes from a d_head x d_head
matrix once the vocabulary is folded into a Gram (row-vector convention, s = attn_scale):

    G   = W_U^T-side Gram  W_U @ W_E_eff          [d_model, d_model]  (full OV:  lambda(W_O G W_V))
    G_E = W_E_eff^T @ W_E_eff                      [d_model, d_model]  (full QK:  lambda(W_K^T G_E W_Q) / s)

Both are formed in one pass over the chunks of W_E_eff (embedding.embed_rows). The copying score of a spectrum is
sum(lambda) / sum(|lambda|), in [-1, 1]; the small eigenproblems are solved in float64 (eig is ill-conditioned for
non-symmetric matrices).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from circuits_core.circuits.embedding import EMBED_CHUNK, embed_chunks_cost, embed_rows
from circuits_core.circuits.folded import circuit_weight, layer_weights, read_copies
from circuits_core.circuits.head_circuits import attention
from circuits_core.circuits.host_linalg import eigvals
from circuits_core.cost import Cost, float64_copy_size
from circuits_core.model.transformer import Transformer

GRAM_BLOCKS = 4  # column blocks of the symmetric G_E: the 10 of 16 blocks on and above the diagonal are formed


def _grams(
    model: Transformer, unembed: bool, embed: bool, take: Callable[[], slice | None] | None = None
) -> tuple[Tensor | None, Tensor | None]:
    """(G, G_E) [d_model, d_model] each, float64 totals (None where not asked), from one pass over the chunks of
    W_E_eff: each chunk's product in the model's dtype, added to the totals in float64. A float32 running sum over
    Gemma-3 270M's 128 chunks of 2,048 rows left G within 1.1e-6 of a float64 reference (relative to its largest
    entry), float64 totals within 1.8e-8; the float64 additions cost ~3 % of the products."""
    d = model.cfg.d_model
    blocks = _gram_blocks(d)
    G, G_E = (
        torch.zeros(d, d, dtype=torch.float64, device=model.W_E.device) if asked else None for asked in [unembed, embed]
    )
    part = torch.empty(d * d, dtype=model.W_E.dtype, device=model.W_E.device)  # one chunk's product, reused
    for rows, X in embed_rows(model, take, reuse=True):  # X [chunk, d], used up before the next chunk
        # MKL's product (torch.mm), not linear.affine's oneDNN: on this strided W_U slice 9.9 against 15.1 ms per
        # 1,024 vocabulary rows of Gemma-3 270M (d_model 640, one thread, alternated in one process, load 1.9)
        if G is not None:
            G += torch.mm(model.W_U[:, rows], X, out=part.view(d, d))
        if G_E is not None:  # G_E[blk, a:] += X[:, blk]^T X[:, a:]: the blocks on and above the diagonal
            for a, b in blocks:
                G_E[a:b, a:] += torch.mm(X[:, a:b].T, X[:, a:], out=part[: (b - a) * (d - a)].view(b - a, d - a))
    return G, None if G_E is None else _mirrored(G_E, blocks)


def _gram_blocks(d: int) -> list[tuple[int, int]]:
    """The GRAM_BLOCKS column blocks [a, b) of a d x d Gram (fewer when d < GRAM_BLOCKS)."""
    edges = [d * i // GRAM_BLOCKS for i in range(GRAM_BLOCKS + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]


def _mirrored(G_E: Tensor, blocks: list[tuple[int, int]]) -> Tensor:
    """G_E [d, d] made symmetric in place from its upper triangle (the blocks on and above the diagonal that _grams
    formed): each diagonal block's upper triangle mirrored (its own temporaries), each block below the diagonal copied
    from its transpose, no [d, d] temporary (a whole triu() + triu(1).T held three beside G_E: 4 x 128 MiB at d_model
    4096)."""
    for a, b in blocks:
        D = G_E[a:b, a:b]
        D.copy_(D.triu() + D.triu(1).T)
        G_E[b:, a:b] = G_E[a:b, b:].T
    return G_E


def embed_grams(model: Transformer, take: Callable[[], slice | None] | None = None) -> tuple[Tensor, Tensor]:
    """(G = W_U @ W_E_eff, G_E = W_E_eff^T @ W_E_eff), each [d_model, d_model] in float64 (the totals of _grams, for a
    caller that adds several workers' partial Grams before rounding them to the model's dtype once), from one pass over
    the chunks of W_E_eff (each chunk normalised once). G_E is symmetric: only its column blocks on and above the
    diagonal are formed (GRAM_BLOCKS = 4: 10 of 16 blocks), the rest is their mirror. `take`: only the vocabulary rows
    it hands out (schedule.shared_chunks shared by several threads: their Grams add up to the whole)."""
    G, G_E = _grams(model, unembed=True, embed=True, take=take)
    assert G is not None and G_E is not None
    return G, G_E


def unembed_embed_gram(model: Transformer) -> Tensor:
    """G = W_U @ W_E_eff [d_model, d_model] in the model's dtype, formed once per model for all full OV spectra."""
    G = _grams(model, unembed=True, embed=False)[0]
    assert G is not None
    return G.to(model.W_E.dtype)


def embed_gram(model: Transformer) -> Tensor:
    """G_E = W_E_eff^T @ W_E_eff [d_model, d_model] in the model's dtype, formed once per model for all full QK spectra
    (upper blocks mirrored, as embed_grams)."""
    G_E = _grams(model, unembed=False, embed=True)[1]
    assert G_E is not None
    return G_E.to(model.W_E.dtype)


def grams_cost(model: Transformer, unembed: bool, embed: bool) -> Cost:
    """_grams: the float64 totals asked [d_model, d_model] each, one chunk's product in W_E's dtype, embed_rows'
    chunks (embed_chunks_cost), and after the pass (its last chunk still held) G_E's mirroring, three of a diagonal
    block's [d_model / GRAM_BLOCKS]^2 in float64; FLOPs: the chunks' products."""
    d = model.cfg.d_model
    totals = (int(unembed) + int(embed)) * d * d * 8
    part = d * d * model.W_E.element_size()
    mirror = 3 * max(b - a for a, b in _gram_blocks(d)) ** 2 * 8 if embed else 0
    flops = (2 * model.cfg.d_vocab * d * d if unembed else 0) + (embed_gram_flops(model) if embed else 0)
    return Cost(totals + part + embed_chunks_cost(model, reuse=True).peak_bytes + mirror, flops=flops)


def model_gram_cost(model: Transformer, unembed: bool) -> Cost:
    """unembed_embed_gram (`unembed`) or embed_gram: one Gram's pass (grams_cost), then its copy in W_E's dtype beside
    the float64 total (none for float64 weights)."""
    d, size = model.cfg.d_model, model.W_E.element_size()
    return grams_cost(model, unembed, not unembed).then(Cost(d * d * (8 + (size if size != 8 else 0))))


def embed_gram_flops(model: Transformer) -> int:
    """FLOPs of embed_gram: each vocabulary row's products for the column blocks on and above the diagonal."""
    d = model.cfg.d_model
    return sum(2 * model.cfg.d_vocab * (b - a) * (d - a) for a, b in _gram_blocks(d))


def _spectrum(M: Tensor) -> Tensor:
    # eig is ill-conditioned for non-symmetric matrices: solve the small ones in float64.
    return eigvals(M.double())


def ov_matrices(model: Transformer, G: Tensor | None = None) -> Tensor:
    """[n_layers, n_heads, d_head, d_head] in the model's dtype: W_O G W_V of every head, whose eigenvalues are the
    full OV circuit's nonzero ones (ov_eigenvalues)."""
    G = unembed_embed_gram(model) if G is None else G  # [d, d]
    # layer by layer (no stacked [L, H, d, d_h] copies of W_V, W_O and G W_V: ~110 MiB of fresh pages on GPT-2 small)
    # W_O G W_V [H, d_h, d_h] per layer, G W_V once per key/value head (shared by its group); an output norm's gain
    # folded into W_O (folded.py); written into one tensor (no list of layers beside a stacked copy)
    cfg = model.cfg
    out = torch.empty(cfg.n_layers, cfg.n_heads, cfg.d_head, cfg.d_head, dtype=G.dtype, device=G.device)
    for layer in range(cfg.n_layers):
        G_W_V = attention(model, layer).per_head(G @ circuit_weight(model, layer, "W_V"))  # [H, d, d_h]
        torch.matmul(circuit_weight(model, layer, "W_O"), G_W_V, out=out[layer])
    return out


def ov_eigenvalues(model: Transformer, G: Tensor | None = None) -> Tensor:
    """[n_layers, n_heads, d_head] complex: the nonzero eigenvalues of each full OV circuit.

    lambda(W_E W_V W_O W_U) \\ {0} = lambda(W_O (W_U W_E) W_V) = lambda(W_O G W_V), d_head x d_head.
    """
    return _spectrum(ov_matrices(model, G))  # eig of [L, H, d_h, d_h]


def gram_queries(model: Transformer, G_E: Tensor | None = None) -> Tensor:
    """G_E W_Q [n_layers, n_heads, d_model, d_head]: the query side of every full QK circuit (qk_eigenvalues), which
    the K-composition positivities read too (qk_paths.k_composition_positivity)."""
    G_E = embed_gram(model) if G_E is None else G_E  # [d, d]
    cfg = model.cfg
    out = torch.empty(cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head, dtype=G_E.dtype, device=G_E.device)
    for layer in range(cfg.n_layers):  # into one tensor, layer by layer: no stacked copy of W_Q
        torch.matmul(G_E, circuit_weight(model, layer, "W_Q"), out=out[layer])  # QK-norm gain folded (folded.py)
    return out


def qk_matrices(model: Transformer, G_E: Tensor | None = None, G_E_W_Q: Tensor | None = None) -> Tensor:
    """[n_layers, n_heads, d_head, d_head] in the model's dtype: W_K^T G_E W_Q / s of every head, whose eigenvalues are
    the full QK circuit's nonzero ones (qk_eigenvalues); G_E_W_Q: gram_queries when given."""
    GW_Q = gram_queries(model, G_E) if G_E_W_Q is None else G_E_W_Q  # [L, H, d, d_h]
    cfg = model.cfg
    out = torch.empty(cfg.n_layers, cfg.n_heads, cfg.d_head, cfg.d_head, dtype=GW_Q.dtype, device=GW_Q.device)
    for layer in range(cfg.n_layers):  # layer by layer: no stacked W_K; into one tensor
        torch.matmul(layer_weights(model, layer, "W_K").transpose(-2, -1), GW_Q[layer], out=out[layer])
    return out.div_(cfg.scale)


def qk_eigenvalues(model: Transformer, G_E: Tensor | None = None, G_E_W_Q: Tensor | None = None) -> Tensor:
    """[n_layers, n_heads, d_head] complex: nonzero eigenvalues of each full QK circuit (scaled by 1/s).

    lambda(W_E W_Q W_K^T W_E^T / s) \\ {0} = lambda(W_K^T (W_E^T W_E) W_Q) / s; G_E_W_Q: gram_queries when given.
    """
    return _spectrum(qk_matrices(model, G_E, G_E_W_Q))  # eig of [L, H, d_h, d_h]


def copying_score(eigenvalues: Tensor) -> Tensor:
    """sum(lambda) / sum(|lambda|) over the last axis, in [-1, 1] (0 when every eigenvalue is 0)."""
    total = eigenvalues.abs().sum(-1)
    return torch.where(total > 0, eigenvalues.sum(-1).real / total.clamp_min(1e-300), 0.0)


def ov_copying_scores(model: Transformer, G: Tensor | None = None) -> Tensor:
    """[n_layers, n_heads] eigenvalue copying score of every full OV circuit (float64)."""
    return copying_score(ov_eigenvalues(model, G))


def ov_copying_scores_flops(model: Transformer) -> int:
    """ov_copying_scores: G = W_U W_E_eff (one product per vocabulary chunk), then per layer G W_V per key/value head
    and W_O (G W_V) per query head (the eigenvalues are not products)."""
    cfg = model.cfg
    d, dh = cfg.d_model, cfg.d_head
    return 2 * d * cfg.d_vocab * d + cfg.n_layers * (2 * cfg.n_kv_heads * d * d * dh + 2 * cfg.n_heads * dh * d * dh)


def ov_copying_scores_cost(model: Transformer) -> Cost:
    """ov_copying_scores: G (model_gram_cost), then beside it in W_E's dtype the [n_layers, n_heads, d_head, d_head]
    matrices W_O G W_V and one layer's G W_V per key/value head and per query head (with the weights as read:
    folded.read_copies), then their float64 copy (unless float64) and the complex eigenvalues (the per-thread parts
    and their concatenation); FLOPs: ov_copying_scores_flops."""
    cfg, size = model.cfg, model.W_E.element_size()
    d, dh, L, H = cfg.d_model, cfg.d_head, cfg.n_layers, cfg.n_heads
    matrices = L * H * dh * dh * size
    layer = (H + cfg.n_kv_heads) * d * dh * size + read_copies(model, "W_V", "W_O")
    spectra = L * H * dh * dh * float64_copy_size(model.W_E.dtype) + 2 * L * H * dh * 16
    own = Cost(d * d * size + matrices + max(layer, spectra))
    return Cost(model_gram_cost(model, unembed=True).then(own).peak_bytes, flops=ov_copying_scores_flops(model))


def qk_copying_scores(model: Transformer, G_E: Tensor | None = None, G_E_W_Q: Tensor | None = None) -> Tensor:
    """[n_layers, n_heads] eigenvalue positivity of every full QK circuit (same-token matching, float64)."""
    return copying_score(qk_eigenvalues(model, G_E, G_E_W_Q))


def head_spectra_cost(model: Transformer, n_positions: int) -> Cost:
    """One head's summary: OV/QK eigenvalues of every head (G_E W_Q [L, H, d_model, d_head], one layer's G W_V at a
    time), the two Grams, singular values, and positional_qk on n_positions (scores and pattern [n, n]); answer: 2
    complex spectra, 2 singular-value lists, the [n, n] pattern."""
    cfg, size = model.cfg, model.W_E.element_size()
    products = (cfg.n_layers + 1) * cfg.n_heads * cfg.d_model * cfg.d_head * size
    grams = (2 * 8 + 2 * size) * cfg.d_model**2 + 2 * EMBED_CHUNK * cfg.d_model * size  # float64 totals, a product
    positional = 3 * n_positions * max(n_positions, cfg.d_model) * size
    return Cost(products + grams + positional).with_answer(numbers=6 * cfg.d_head + n_positions**2, labels=10)
