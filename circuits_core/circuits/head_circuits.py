"""Single-head circuits: the direct path, QK and OV circuits, their full (token) circuits, positional QK.

Paper sections (Elhage et al. 2021): "Zero-Layer Transformers" (direct path W_U W_E), "One-Layer
Attn-Only Transformers" (QK circuit W_E^T W_QK W_E, OV circuit W_U W_OV W_E, skip-trigrams). See docs/maths.md
§2.2-2.8; every head's eigenvalue copying scores are in copying_spectra.py, one head's copying metrics in copying.py,
its skip-trigrams in skip_trigrams.py.

Convention: row vectors as TransformerLens (`x @ W`), so every full circuit is the paper's matrix
transposed or not as below (V = d_vocab, d = d_model, d_h = d_head, s = attn_scale):

    direct_path        W_E_eff @ W_U                       [V, V]  rows: current token, cols: next-token logit
    qk_circuit         W_Q @ W_K^T                         [d, d]  (= the paper's W_QK) rows: query side
    ov_circuit         W_V @ W_O                           [d, d]  (= the paper's W_OV transposed) rows: read side
    full_qk_circuit    W_E_eff W_Q W_K^T W_E_eff^T / s     [V, V]  rows: query (destination), cols: key (source)
                       -- scaled like real attention scores
    full_ov_circuit    W_E_eff W_V W_O W_U                 [V, V]  rows: source (attended) token, cols: output logit

All are FactoredMatrix objects whose inner dimension is d_h (or d for the direct path): nothing sized
V x V is ever allocated.

LayerNorm: W_E_eff is W_E with the first layer's ln1 applied row by row (embedding.py, where its exactness is
stated), as the paper does for its one-layer skip-trigrams. The direct path uses ln_final applied to W_E
rows instead. Circuits of later layers use the same W_E_eff: they describe the direct token -> head path
(the paper's one-layer terms), ignoring the LN scale at that layer. Attention biases are ignored (their
effect on the pattern is only the per-key term b_Q W_K^T x, docs/maths.md §1.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from circuits_core.circuits.embedding import (
    EMBED_CHUNK,
    apply_ln_rows,
    embed_eff_matmul,
    embed_eff_rows,
    embed_product,
    embed_rows_cost,
    embed_unformed,
    first_norm,
    ln_rows_cost,
    unnormalised,
)
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.circuits.folded import head_weights
from circuits_core.circuits.global_topk import topk_global_cost, topk_global_flops
from circuits_core.circuits.global_topk_folded import folded_flops
from circuits_core.circuits.product_factor import ProductFactor
from circuits_core.circuits.qk_forms import folded_query_key, token_factors, token_scale
from circuits_core.cost import Cost
from circuits_core.errors import InvalidInputError, NotFoundError
from circuits_core.model.half_products import half_matmul
from circuits_core.model.transformer import Attention, Block, Transformer


def check_head(model: Transformer, layer: int, head: int) -> None:
    cfg = model.cfg
    if not 0 <= layer < cfg.n_layers:
        raise NotFoundError(f"head L{layer}H{head} out of range: the model has {cfg.n_layers} layers")
    if not 0 <= head < cfg.n_heads:
        raise NotFoundError(f"head L{layer}H{head} out of range: the model has {cfg.n_heads} heads per layer")


def check_token(model: Transformer, token: int) -> None:
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < model.cfg.d_vocab:
        raise InvalidInputError(f"token id must be an integer in [0, {model.cfg.d_vocab}), got {token!r}")


def _block(model: Transformer, layer: int) -> Block:
    block = model.blocks[layer]
    assert isinstance(block, Block)
    return block


def attention(model: Transformer, layer: int) -> Attention:
    """Layer `layer`'s attention (its W_Q, W_K, W_V, W_O), the layer checked."""
    check_head(model, layer, 0)
    return _block(model, layer).attn


# -- the circuits -------------------------------------------------------------------------------------
def direct_path(model: Transformer, tokens: Tensor | None = None) -> FactoredMatrix:
    """W_E_eff @ W_U [d_vocab, d_vocab]: rows current token, columns next-token logit (the bigram term).

    With LayerNorm, W_E_eff here is ln_final applied to W_E rows (the zero-layer input to the unembedding).
    b_U and positional terms are not included. With `tokens` (ids [n]): the [n, n] submatrix of those rows and
    columns, ln_final applied to those rows of W_E only (on every row, an 8B model's [128256, 4096] would be formed).
    """
    W_E = model.W_E if tokens is None else model.W_E[tokens]  # [n, d_model]
    if model.cfg.normalization_type is not None:
        W_E = apply_ln_rows(model.ln_final, W_E)
    return FactoredMatrix(W_E, model.W_U if tokens is None else model.W_U[:, tokens])


def qk_circuit(model: Transformer, layer: int, head: int) -> FactoredMatrix:
    """W_QK = W_Q @ W_K^T [d_model, d_model] (inner d_head): rows query-side residual, cols key-side."""
    check_head(model, layer, head)
    W_Q, W_K, _, _ = head_weights(model, layer, head)  # QK-norm gains folded (the weight-level "bilinear" form)
    return FactoredMatrix(W_Q, W_K.T)


def ov_circuit(model: Transformer, layer: int, head: int) -> FactoredMatrix:
    """W_V @ W_O [d_model, d_model] (inner d_head): rows the residual read at the source, cols written."""
    check_head(model, layer, head)
    _, _, W_V, W_O = head_weights(model, layer, head)  # an output norm's gain folded into W_O
    return FactoredMatrix(W_V, W_O)


def full_qk_circuit(model: Transformer, layer: int, head: int, tokens: Tensor | None = None) -> FactoredMatrix:
    """W_E_eff W_Q W_K^T W_E_eff^T / attn_scale [d_vocab, d_vocab]: rows query token, cols key token.

    Entry [b, a] is the attention score (as in hook_attn_scores) of a query token b on a key token a,
    token part only: positional and bias terms are not included. With `tokens` (ids [n]): the [n, n] submatrix
    of those rows and columns, its factors formed on those tokens only. Under QK-norm the rows and columns carry each
    token's own 1 / rho (the exact "cosine" form, qk_forms.py: the score the softmax sees, before any score cap).
    """
    check_head(model, layer, head)
    W_Q, W_K = folded_query_key(model, layer)  # (not head_weights: its V and O are not read here)
    W_Q, W_K = W_Q[head], W_K[head // model.cfg.group_size]
    if tokens is not None:
        W_E = embed_eff_rows(model, tokens)  # [n, d_model]
        query, key = W_E @ W_Q / model.cfg.scale, W_E @ W_K
    else:
        query, key = embed_eff_matmul(model, W_Q) / model.cfg.scale, embed_eff_matmul(model, W_K)  # [V, d_h]
    query, key = token_factors(model, layer, head, query, key, tokens)  # exact under QK-norm and latent attention
    return FactoredMatrix(query, key.T)


def full_ov_circuit(model: Transformer, layer: int, head: int, tokens: Tensor | None = None) -> FactoredMatrix:
    """W_E_eff W_V W_O W_U [d_vocab, d_vocab]: rows source (attended) token, cols output logit.

    Entry [a, c] is how much attending to token a raises the logit of token c (ignoring the LayerNorms
    after the head). With `tokens` (ids [n]): the [n, n] submatrix of those rows and columns, its factors
    formed on those tokens only.
    """
    check_head(model, layer, head)
    _, _, W_V, W_O = head_weights(model, layer, head)  # under an output norm: exact up to its per-token scale
    if tokens is not None:
        return FactoredMatrix(embed_eff_rows(model, tokens) @ W_V, W_O @ model.W_U[:, tokens])
    # B as the transpose of W_U^T W_O^T [d_vocab, d_head]: the same values as W_O @ W_U (bitwise, measured on four
    # model shapes), 1.2-1.9x faster, and its columns contiguous, as global top-k's column bounds read them
    left = embed_product(model, W_V)
    if left is not None and ov_unformed(model) and W_O.dtype == model.W_U.dtype:  # both kept as their products
        return FactoredMatrix.of_products(left, ProductFactor(model.W_U.T, W_O.T))
    return FactoredMatrix(embed_eff_matmul(model, W_V), (model.W_U.T @ W_O.T).T)


def ov_unformed(model: Transformer) -> bool:
    """Whether full_ov_circuit on every token keeps both factors as their products (FactoredMatrix.of_products)."""
    return embed_unformed(model) and model.W_U.dtype == model.W_E.dtype


def full_ov_row(model: Transformer, layer: int, head: int, source_token: int) -> Tensor:
    """Row a of the full OV circuit [d_vocab]: the logit effect of attending to token a (one vector-matrix
    chain through the residual stream, no [V, d_head] factor)."""
    check_head(model, layer, head)
    check_token(model, source_token)
    _, _, W_V, W_O = head_weights(model, layer, head)
    x = embed_eff_rows(model, [source_token], model.compute_dtype)  # [1, d_model]
    return half_matmul(half_matmul(half_matmul(x, W_V), W_O), model.W_U)[0]  # [V] (float32 on half weights)


def direct_row(model: Transformer, token: int) -> Tensor:
    """Row `token` of the direct path [d_vocab] (ln_final on that one row of W_E, then W_U)."""
    check_token(model, token)
    row = model.W_E[[token]].to(model.compute_dtype)  # [1, d_model]
    x = row if model.cfg.normalization_type is None else apply_ln_rows(model.ln_final, row)
    return half_matmul(x, model.W_U)[0]  # [V] (float32 on half weights)


def full_qk_col(model: Transformer, layer: int, head: int, key_token: int) -> Tensor:
    """Column a of the full QK circuit [d_vocab]: the score of every query token on key token a."""
    check_head(model, layer, head)
    check_token(model, key_token)
    if model.cfg.latent_attention:  # the exact token table's column (its factors carry each token's latent scales)
        return full_qk_circuit(model, layer, head).cols([key_token])[0]
    W_Q, W_K, _, _ = head_weights(model, layer, head)
    k = half_matmul(embed_eff_rows(model, [key_token], model.compute_dtype), W_K)  # [1, d_h]
    col = embed_eff_matmul(model, half_matmul(W_Q, k.T))[:, 0] / model.cfg.scale  # [V]
    if model.cfg.qk_norm is None:
        return col
    return col * token_scale(model, layer, head, "query") * token_scale(model, layer, head, "key", [key_token])


# -- positional QK ----------------------------------------------------------------------------------
@dataclass
class PositionalQK:
    scores: Tensor  # [n, n] W_pos W_QK W_pos^T / s, rows query position, cols key position (unmasked)
    pattern: Tensor  # [n, n] causal row softmax of scores (zero above the diagonal)
    previous_token: float  # mean of pattern[i, i-1], i >= 1
    current_token: float  # mean of pattern[i, i]


def positional_qk(model: Transformer, layer: int, head: int, n: int | None = None) -> PositionalQK:
    """The position-position part of the attention scores and its causal pattern (docs/maths.md §2.4).

    Exact for shortformer models (positions enter queries and keys after ln1, untouched). For standard
    positions W_pos goes through the residual stream: ln1 is applied to W_pos rows and tokens are ignored,
    so it is only the positional tendency of the head.
    """
    check_head(model, layer, head)
    kind = model.cfg.positional_embedding_type
    if kind not in ("shortformer", "standard") or model.W_pos is None:
        raise InvalidInputError(
            f"positional QK needs learned positions (shortformer or standard), the model has {kind!r}"
        )
    n = model.cfg.n_ctx if n is None else n
    if not 2 <= n <= model.cfg.n_ctx:
        raise InvalidInputError(f"n must be in [2, n_ctx={model.cfg.n_ctx}], got {n}")
    P = model.W_pos[:n]  # [n, d_model]
    if kind == "standard":
        P = apply_ln_rows(_block(model, layer).ln1, P)
    W_QK = qk_circuit(model, layer, head)
    scores = (P @ W_QK.A) @ (W_QK.B @ P.T) / model.cfg.scale  # [n, n]
    causal = torch.ones(n, n, dtype=torch.bool, device=P.device).tril()
    pattern = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)  # [n, n]
    return PositionalQK(
        scores=scores,
        pattern=pattern,
        previous_token=float(pattern.diagonal(-1).mean()),
        current_token=float(pattern.diagonal().mean()),
    )


# -- costs (circuits_core.cost): priced before the computations above run ---------------------------------
def factors_cost(model: Transformer) -> Cost:
    """Building a full circuit's [d_vocab, d_head] factors (embed_eff_matmul: one LN chunk at a time)."""
    cfg, size = model.cfg, model.W_E.element_size()
    return Cost((2 * cfg.d_vocab * cfg.d_head + 2 * EMBED_CHUNK * cfg.d_model) * size)


Circuit = Literal["ov", "qk", "direct"]


def top_cost(
    model: Transformer,
    k: int,
    budget_bytes: int,
    line: bool,
    n_tokens: int | None = None,
    circuit: Circuit = "ov",
    side: Literal["row", "column"] = "row",
) -> Cost:
    """A full circuit's top k: one row or column (`line`: [d_vocab] values), else topk_global over the
    n_tokens x n_tokens submatrix (default all tokens); answer: k (row token, column token, value).

    FLOPs: the circuit's factors (on the n_tokens only where the circuit is built on them; a rotary QK circuit is
    rotated on every token's factors first), or the one line, then the search (circuit_flops)."""
    cfg, size = model.cfg, model.W_E.element_size()
    n = cfg.d_vocab if n_tokens is None else n_tokens
    flops = circuit_flops(model, circuit, line, n_tokens, side)
    if line:
        return (
            factors_cost(model).then(Cost(3 * cfg.d_vocab * size, flops=flops)).with_answer(numbers=3 * k, labels=2 * k)
        )
    inner = cfg.d_model if circuit == "direct" else cfg.d_head
    search = topk_global_cost(n, inner, n, k, budget_bytes, size)
    searched = Cost(search.peak_bytes, search.answer_bytes, flops).with_answer(labels=2 * k)
    if n_tokens is not None:
        formed = direct_factors_cost(model, n_tokens) if circuit == "direct" else token_factors_cost(model, n_tokens)
        return formed.then(Cost(2 * n * inner * size) + searched)  # the search beside the two factors
    return (direct_factors_cost(model) if circuit == "direct" else factors_cost(model)) + searched


def direct_factors_cost(model: Transformer, n_tokens: int | None = None) -> Cost:
    """Forming direct_path's factors (every token, or `n_tokens` tokens' rows and columns, in W_E's dtype): ln_final
    on W_E's rows (ln_rows_cost; on n_tokens rows gathered first), then W_U's columns gathered beside them."""
    cfg, size = model.cfg, model.W_E.element_size()
    n = cfg.d_vocab if n_tokens is None else n_tokens
    rows = n * cfg.d_model * size  # [n, d_model]: W_E's rows gathered, or W_U's columns
    normed = ln_rows_cost(model, n).peak_bytes if cfg.normalization_type is not None else 0
    return Cost(normed if n_tokens is None else rows + max(normed, rows))


def token_factors_cost(model: Transformer, n: int) -> Cost:
    """Forming a head's full OV or QK factors on n tokens (full_ov_circuit, full_qk_circuit or
    rotary.full_qk_circuit_at with `tokens`, in W_E's dtype): W_E_eff's rows (embed_rows_cost) and beside them the
    [n, d_head] products (OV's columns of W_U [d_model, n] gathered once those rows are freed)."""
    cfg = model.cfg
    return Cost(embed_rows_cost(model, n).peak_bytes + 4 * n * cfg.d_head * model.W_E.element_size())


def circuit_flops(
    model: Transformer,
    circuit: Circuit,
    line: bool,
    n_tokens: int | None = None,
    side: Literal["row", "column"] = "row",
) -> int:
    """FLOPs of a circuit's table as app/views/circuits.py reads it: a token's line (the row of OV and direct, the
    QK row or column), else the global top-k search of the n_tokens x n_tokens submatrix (default every token)
    with the factors it reads."""
    cfg = model.cfg
    rotary = cfg.positional_embedding_type == "rotary"
    if line:
        if circuit != "qk":
            return line_flops(model, "ov-row" if circuit == "ov" else "direct-row")
        if rotary:
            return line_flops(model, "qk-row-at" if side == "row" else "qk-column-at")
        if side == "column":
            return line_flops(model, "qk-column")
        return full_qk_flops(model) + 2 * cfg.d_head * cfg.d_vocab  # the factors, then the row
    n = cfg.d_vocab if n_tokens is None else n_tokens
    if circuit == "direct":  # ln_final on W_E's rows: no product before the search
        return topk_global_flops(n, cfg.d_model, n)
    if circuit == "ov":
        factors = full_ov_flops(model, n_tokens)
        if n_tokens is None and ov_unformed(model):  # the search on the products first (global_topk_folded)
            factors += folded_flops(n, cfg.d_model, cfg.d_head, n, cfg.d_model)
    else:  # the factors on the n tokens (a rotary circuit's query side then rotated: rotary.full_qk_circuit_at)
        factors = full_qk_flops(model, n_tokens) + (2 * n * cfg.d_head**2 if rotary else 0)
    return factors + topk_global_flops(n, cfg.d_head, n)


# -- FLOPs (matrix products, 2 per multiply-add, as torch.utils.flop_counter counts them) of the circuits above -----
def embed_matmul_flops(model: Transformer, n_cols: int) -> int:
    """embed_eff_matmul(model, W [d_model, n_cols]): one product with the raw W_E, and b W under a norm with a bias."""
    cfg = model.cfg
    bias = not unnormalised(model) and getattr(first_norm(model), "b", None) is not None
    return 2 * cfg.d_vocab * cfg.d_model * n_cols + (2 * cfg.d_model * n_cols if bias else 0)


def token_scales_flops(model: Transformer, n_query: int, n_key: int) -> int:
    """head_token_scales: the QK-norm rho of n_query tokens' queries (every query head of the layer, token_rho) and of
    n_key tokens' keys (every key/value head); 0 without QK-norm."""
    cfg = model.cfg
    if cfg.qk_norm is None:
        return 0
    return 2 * cfg.d_model * cfg.d_head * (n_query * cfg.n_heads + n_key * cfg.n_kv_heads)


def latent_factor_flops(model: Transformer, n_rows: int) -> int:
    """Multi-head latent attention's extra work in a QK table's factors (0 otherwise): the layer's effective W_Q
    (the query latent's up-projections of every head, when the model has a query latent) and W_K (the key/value
    latent's), and each of n_rows tokens' latent scales rho_q, rho_kv through the embedding (qk_forms.token_factors)."""
    cfg = model.cfg
    if not cfg.latent_attention:
        return 0
    d, H, r_q, r_kv = cfg.d_model, cfg.n_heads, cfg.mla_q_rank or 0, cfg.mla_kv_rank or 0
    weights = 2 * d * r_q * H * (cfg.mla_d_nope + (cfg.rotary_dim or 0)) + 2 * d * r_kv * H * cfg.mla_d_nope
    return weights + 2 * n_rows * d * (r_q + r_kv)


def full_ov_flops(model: Transformer, n_tokens: int | None = None) -> int:
    """full_ov_circuit's factors on n_tokens tokens (None: every token, through embed_eff_matmul)."""
    cfg = model.cfg
    if n_tokens is None:
        return embed_matmul_flops(model, cfg.d_head) + 2 * cfg.d_head * cfg.d_model * cfg.d_vocab
    return 4 * n_tokens * cfg.d_model * cfg.d_head


def full_qk_flops(model: Transformer, n_tokens: int | None = None) -> int:
    """full_qk_circuit's (or rotary.full_qk_factors') factors on n_tokens tokens (None: every token), each token's
    QK-norm scale included."""
    cfg = model.cfg
    if n_tokens is None:
        latent = latent_factor_flops(model, cfg.d_vocab)
        return 2 * embed_matmul_flops(model, cfg.d_head) + token_scales_flops(model, cfg.d_vocab, cfg.d_vocab) + latent
    latent = latent_factor_flops(model, n_tokens)
    return 4 * n_tokens * cfg.d_model * cfg.d_head + token_scales_flops(model, n_tokens, n_tokens) + latent


def line_flops(model: Transformer, line: str) -> int:
    """One token's line of a full circuit over every token: "ov-row" (full_ov_row), "qk-column" (full_qk_col),
    "direct-row" (direct_row); on rotary models "qk-row-at" / "qk-column-at" (rotary.full_qk_row_at / _col_at: the
    line through R(δ)). A QK line carries the query (or key) QK-norm scale of every token."""
    cfg = model.cfg
    d, dh, V = cfg.d_model, cfg.d_head, cfg.d_vocab
    if line == "ov-row":
        return 4 * d * dh + 2 * d * V
    if line == "direct-row":
        return 2 * d * V
    if cfg.latent_attention and line.startswith("qk-"):  # the line of the exact table: every token's factors first
        return full_qk_flops(model) + (2 * V * dh * dh if line.endswith("-at") else 0) + 2 * V * dh
    rotated = 2 * dh * dh if line.endswith("-at") else 0
    if line in ("qk-column", "qk-column-at"):
        return 4 * d * dh + rotated + embed_matmul_flops(model, 1) + token_scales_flops(model, V, 1)
    if line == "qk-row-at":
        return 4 * d * dh + rotated + embed_matmul_flops(model, 1) + token_scales_flops(model, 1, V)
    raise ValueError(f"no line {line!r}")
