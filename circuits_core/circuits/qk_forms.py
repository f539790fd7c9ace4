"""The QK circuit under QK-norm (Qwen3, Gemma 3: per head; OLMo 2/3: over a layer's heads), in the form each view uses.

QK-norm divides each projection by its RMS before the rotation and multiplies by a gain, q = x W_Q / rho_q(x) * gamma_q
(qk_norm.py). With Gamma = diag(gamma) folded on the projection side (never after R: Gamma commutes with R only when
both entries of a rotation pair are equal), the score of query x_i on key x_j at offset delta is
    score = x_i [W_Q Gamma_q R(delta) Gamma_k W_K^T] x_j^T / (s rho_q(x_i) rho_k(x_j)),
one fixed bilinear form read through two positive per-token scalars. Three forms follow (QK_FORMS), and every QK number
the engine returns says which one it is in:
- "exact" (no QK-norm): the paper's bilinear form x W_Q R W_K^T x^T / s is the score itself.
- "cosine" (token level, exact): a token table entry uses each token's own normalisation, measured through the
  embedding (rho of W_E_eff[t] W, per head or per layer), as row and column scalings of the factored table, so the
  entry is exactly the score the softmax sees for those two tokens on the direct path; up to the constant
  d_head / s it is the cosine-like u_q Gamma_q R Gamma_k u_k^T of the tokens' unit projections u = xW / ||xW||.
- "bilinear" (weight level): composition scores, virtual weights and eigenvalue scores use W_Q Gamma_q R Gamma_k
  W_K^T and leave the per-token normalisations out (rho_k(j) can change key rankings; the reading subspaces are the
  model's). On OLMo 2 the normalisation is shared by the layer's heads, so rho is one scalar per token and layer.
- "frozen-norm" (prompt level): path expansions freeze rho per token on the prompt, as LayerNorm scales are frozen
  (qk_paths.frozen_qk_norm), so their terms sum to the model's scores.
Multi-head latent attention (latent_circuits.py) has its own three: the content term is divided by rho_q(i) rho_kv(j)
and the rotary term by rho_q(i) only, so no single pair of scalings makes one table exact: "latent-token" scales the
query rows by 1 / rho_q(t) and the content dims of the key rows by 1 / rho_kv(t) (still a rank-d_head factored table),
"latent-bilinear" is A_h + C_h R D^T with the scales left out, "latent-frozen" freezes them on the prompt.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from circuits_core.circuits.embedding import embed_eff_rows, embed_rows
from circuits_core.errors import InvalidInputError
from circuits_core.model.latent_attention import LatentAttention
from circuits_core.model.qk_norm import qk_scale
from circuits_core.model.transformer import Block, Transformer

QKForm = Literal[
    "exact", "cosine", "bilinear", "frozen-norm", "latent-token", "latent-bilinear", "latent-frozen"
]  # fmt: skip
QK_FORMS: dict[str, str] = {
    "exact": "the model's own bilinear form (no QK-norm)",
    "cosine": "token level, exact: each token's own QK-norm scale measured through the embedding",
    "bilinear": "weight level: W_Q Γ_q R Γ_k W_Kᵀ, per-token QK-norm scales left out",
    "frozen-norm": "prompt level: QK-norm scales frozen at the run's values",
    "latent-token": "token level, exact: the content term divided by each token's own latent scales ρ_q, ρ_kv and "
    "the rotary term by ρ_q, measured through the embedding (multi-head latent attention)",
    "latent-bilinear": "weight level: the content term A_h plus the rotary term C_h R Dᵀ, the per-token latent "
    "scales ρ_q, ρ_kv left out (multi-head latent attention)",
    "latent-frozen": "prompt level: the latent scales ρ_q, ρ_kv frozen at the run's values (multi-head latent "
    "attention)",
}


def qk_form(model: Transformer, level: Literal["token", "weight", "prompt"]) -> QKForm:
    """The form a QK number at this level is in for this model (see the module docstring)."""
    if model.cfg.latent_attention:
        return {"token": "latent-token", "weight": "latent-bilinear", "prompt": "latent-frozen"}[level]  # type: ignore[return-value]
    if model.cfg.qk_norm is None:
        return "exact"
    return {"token": "cosine", "weight": "bilinear", "prompt": "frozen-norm"}[level]  # type: ignore[return-value]


def token_factors(
    model: Transformer, layer: int, head: int, query: Tensor, key: Tensor, tokens: Tensor | list[int] | None = None
) -> tuple[Tensor, Tensor]:
    """The factors [n_tokens, d_head] of a token-level QK table (rows of W_E_eff W_Q / s and W_E_eff W_K, unrotated)
    made exact: under QK-norm each row times its token's 1 / rho (the "cosine" form); under multi-head latent
    attention each query row / rho_q(t) and each key row's content dims / rho_kv(t) (the "latent-token" form);
    unchanged otherwise. `tokens`: the rows' token ids (None: every token)."""
    if model.cfg.latent_attention:
        attn = _block(model, layer).attn
        assert isinstance(attn, LatentAttention)
        rho_q, rho_kv = latent_token_rho(model, attn, tokens)
        return query / rho_q[:, None], attn.scale_keys(key, rho_kv)
    scales = head_token_scales(model, layer, head, tokens)
    if scales is None:
        return query, key
    return query * scales[0][:, None], key * scales[1][:, None]


def _block(model: Transformer, layer: int) -> Block:
    block = model.blocks[layer]
    assert isinstance(block, Block)
    return block


def folded_query_key(model: Transformer, layer: int) -> tuple[Tensor, Tensor]:
    """(W_Q Gamma_q [n_heads, d_model, d_head], W_K Gamma_k [n_kv_heads, d_model, d_head]): the layer's query and key
    weights with the QK-norm gains folded on the projection side (the weights themselves without QK-norm)."""
    attn = _block(model, layer).attn
    W_Q, W_K = attn.W_Q, attn.grouped("W_K")
    if model.cfg.qk_norm is None:
        return W_Q, W_K
    return W_Q * attn.q_norm.gain()[:, None, :], W_K * attn.k_norm.gain()[:, None, :]


def latent_token_rho(
    model: Transformer, attn: LatentAttention, tokens: Tensor | list[int] | None = None
) -> tuple[Tensor, Tensor]:
    """(rho_q, rho_kv) [n_tokens] of each token's embedding row (W_E_eff) through a latent attention layer's latent
    norms; every vocabulary token when `tokens` is None (in chunks of EMBED_CHUNK rows)."""
    if tokens is not None:
        return attn.latent_rho(embed_eff_rows(model, tokens))
    rho_q = torch.empty(model.cfg.d_vocab, dtype=model.dtype, device=model.device)
    rho_kv = torch.empty_like(rho_q)
    for span, chunk in embed_rows(model, None, reuse=True):
        rho_q[span], rho_kv[span] = attn.latent_rho(chunk)
    return rho_q, rho_kv


def token_rho(
    model: Transformer, layer: int, side: Literal["query", "key"], tokens: Tensor | list[int] | None = None
) -> Tensor:
    """rho of each token's projection through the embedding, as the layer's QK-norm measures it: [n_tokens, heads]
    per head (heads = n_heads for queries, n_kv_heads for keys), [n_tokens, 1] per layer; every vocabulary token when
    `tokens` is None (in chunks of EMBED_CHUNK rows). Only for models with QK-norm."""
    if model.cfg.qk_norm is None:
        raise InvalidInputError("the model has no QK-norm")
    attn = _block(model, layer).attn
    W = attn.W_Q if side == "query" else attn.grouped("W_K")  # [heads, d, dh], unfolded: what the norm divides
    heads, d, dh = W.shape
    flat = W.permute(1, 0, 2).reshape(d, heads * dh)
    if tokens is not None:
        rows = embed_eff_rows(model, tokens)
        return qk_scale((rows @ flat).view(-1, heads, dh), model.cfg)[..., 0]  # [n, heads or 1]
    out = torch.empty(model.cfg.d_vocab, heads if model.cfg.qk_norm == "head" else 1, dtype=W.dtype, device=W.device)
    for span, chunk in embed_rows(model, None, reuse=True):  # EMBED_CHUNK rows at a time
        out[span] = qk_scale((chunk @ flat).view(-1, heads, dh), model.cfg)[..., 0]
    return out


def token_scale(
    model: Transformer, layer: int, head: int, side: Literal["query", "key"], tokens: Tensor | list[int] | None = None
) -> Tensor:
    """1 / rho of query head `head` (side "query") or of its key/value group ("key") for these tokens (every token when
    None) [n]: the exact "cosine" form's row or column scaling."""
    rho = token_rho(model, layer, side, tokens)  # [n, heads or 1]
    index = head if side == "query" else head // model.cfg.group_size
    return 1.0 / rho[:, index if rho.shape[1] > 1 else 0]


def head_token_scales(
    model: Transformer, layer: int, head: int, tokens: Tensor | list[int] | None = None
) -> tuple[Tensor, Tensor] | None:
    """(1 / rho_q [n_tokens], 1 / rho_k [n_tokens]) for query head `head` and its key/value group: the row and column
    scalings that make a factored token table exact ("cosine" form); None without QK-norm."""
    if model.cfg.qk_norm is None:
        return None
    return token_scale(model, layer, head, "query", tokens), token_scale(model, layer, head, "key", tokens)
