"""The circuits of multi-head latent attention (MLA: DeepSeek-V2/V3; model/latent_attention.py), row vectors.

With x̂ the ln1 output, ρ_q(i) and ρ_kv(j) the RMS of token i's query latent and token j's key/value latent (the
latent norms' per-token scales) and s the softmax scale's divisor, head h's score splits exactly into two terms:

    score_h(i, j) = x̂ᵢ A_h x̂ⱼᵀ / (s ρ_q(i) ρ_kv(j))  +  x̂ᵢ C_h R(i − j) Dᵀ x̂ⱼᵀ / (s ρ_q(i))
    A_h = W_DQ Γq W_UQ^h (W_UK^h)ᵀ Γkv W_DKVᵀ      content term, position-free, rank ≤ d_nope      [d_model, d_model]
    C_h = W_DQ Γq W_QR^h,  D = W_KR               rotary term, content × offset, rank ≤ d_rope;   [d_model, d_rope]
                                                  D, the key's rotary part, is shared by every head of the layer
    OV_h = W_DKV Γkv W_UV^h W_O^h                 read through the latent: head h writes Σⱼ p_ij x̂ⱼ OV_h / ρ_kv(j)

(without a query latent W_DQ Γq is the identity and ρ_q ≡ 1). The content and rotary terms are separate by
construction: A_h never sees the offset, and C_h R Dᵀ is the only place positions enter. Every head's content key and
value read the stream through the one latent W_DKV Γkv (rank kv_rank), so what an earlier head can K- or
V-compose into a layer's heads is bounded by how its output lands in that shared latent subspace.

The engine's per-head W_Q, W_K, W_V (latent_attention.LatentAttention) are these weights with ρ taken as 1:
W_Q^h R(δ) W_K^hᵀ = A_h + C_h R(δ) Dᵀ, W_V^h W_O^h = OV_h, so every weight-level view (Ω_h(δ), spectra, composition)
reads A_h + C_h R Dᵀ; prompt-level terms freeze ρ_q, ρ_kv on the run (`score_terms`), as norm scales are frozen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.embedding import embed_eff_rows
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.circuits.head_circuits import attention, check_head
from circuits_core.errors import InvalidInputError
from circuits_core.model.latent_attention import LatentAttention
from circuits_core.model.transformer import Transformer


@dataclass
class LatentHead:
    """Head h's MLA circuits (module docstring), gains folded, per-token ρ left out."""

    content: FactoredMatrix  # A_h [d_model, d_model], inner d_nope: (W_DQ Γq W_UQ^h) (W_DKV Γkv W_UK^h)ᵀ
    query_rotary: Tensor  # C_h [d_model, d_rope]
    key_rotary: Tensor  # D = W_KR [d_model, d_rope], shared by the layer's heads
    ov: FactoredMatrix  # OV_h [d_model, d_model], inner d_v: (W_DKV Γkv W_UV^h) W_O^h


def latent_attention(model: Transformer, layer: int) -> LatentAttention:
    """Layer `layer`'s latent attention; a model without MLA is refused."""
    attn = attention(model, layer)
    if not isinstance(attn, LatentAttention):
        raise InvalidInputError("the model has no multi-head latent attention (DeepSeek-V2/V3)")
    return attn


def latent_head(model: Transformer, layer: int, head: int) -> LatentHead:
    check_head(model, layer, head)
    attn = latent_attention(model, layer)
    read_q, read_kv = attn.query_reader(), attn.kv_reader()  # [d, q_rank], [d, kv_rank]
    d_v = model.cfg.mla_d_v
    return LatentHead(
        content=FactoredMatrix(read_q @ attn.W_UQ[head], (read_kv @ attn.W_UK[head]).T),
        query_rotary=read_q @ attn.W_QR[head],
        key_rotary=attn.W_KR,
        ov=FactoredMatrix(read_kv @ attn.W_UV[head], attn.W_O[head, :d_v]),
    )


def rotary_term(model: Transformer, layer: int, head: int, offset: int) -> FactoredMatrix:
    """C_h R(δ) Dᵀ [d_model, d_model] (inner d_rope) at offset δ = i − j: the model's own rotation (its layout and
    rope scaling) applied to C_h's rows, R(i) R(j)ᵀ = R(i − j)."""
    h = latent_head(model, layer, head)
    delta = torch.tensor([offset], device=model.device)
    return FactoredMatrix(model.rotate(h.query_rotary, delta, layer), h.key_rotary.T)


def latent_rho(model: Transformer, layer: int, x_hat: Tensor) -> tuple[Tensor, Tensor]:
    """(ρ_q, ρ_kv) [n] of normalised residuals x̂ [n, d_model] entering layer `layer`'s attention (ln1 applied), as the
    latent norms measure them (ρ_q ≡ 1 without a query latent)."""
    return latent_attention(model, layer).latent_rho(x_hat)


def score_terms(
    model: Transformer, layer: int, head: int, x_hat: Tensor, rho_q: Tensor, rho_kv: Tensor
) -> tuple[Tensor, Tensor]:
    """(content, rotary) [n, n]: head h's two score terms on a sequence whose normalised residuals entering the layer
    are x̂ [n, d_model] (position p at row p), with the latent scales frozen at ρ_q, ρ_kv [n]; their sum is the
    model's score before the mask (hook_attn_scores on the causal entries)."""
    h = latent_head(model, layer, head)
    s = model.cfg.scale
    content = (x_hat @ h.content.A) @ (h.content.B @ x_hat.T) / (s * rho_q[:, None] * rho_kv[None, :])
    positions = torch.arange(x_hat.shape[0], device=x_hat.device)  # [n], against the rows of x̂
    q_rot = model.rotate(x_hat @ h.query_rotary, positions, layer)  # [n, d_rope]: x̂ᵢ C_h R(i)
    k_rot = model.rotate(x_hat @ h.key_rotary, positions, layer)  # x̂ⱼ D R(j)
    return content, q_rot @ k_rot.T / (s * rho_q[:, None])


def token_pair_terms(
    model: Transformer, layer: int, head: int, queries: Tensor | list[int], keys: Tensor | list[int], offset: int
) -> tuple[Tensor, Tensor]:
    """(content, rotary) [m]: the two terms of the token-level QK entry of each (query token, key token) pair at offset
    δ, each token's latent scales measured through the embedding (the "latent-token" form, qk_forms.py): content =
    e_q A_h e_kᵀ / (s ρ_q(q) ρ_kv(k)), rotary = e_q C_h R(δ) Dᵀ e_kᵀ / (s ρ_q(q)); their sum is the table's entry."""
    h = latent_head(model, layer, head)
    attn = latent_attention(model, layer)
    e_q, e_k = embed_eff_rows(model, queries), embed_eff_rows(model, keys)  # [m, d_model]
    rho_q, _ = attn.latent_rho(e_q)
    _, rho_kv = attn.latent_rho(e_k)
    s = model.cfg.scale
    content = ((e_q @ h.content.A) * (e_k @ h.content.B.T)).sum(-1) / (s * rho_q * rho_kv)
    delta = torch.tensor([offset], device=model.device)
    rotary = (model.rotate(e_q @ h.query_rotary, delta, layer) * (e_k @ h.key_rotary)).sum(-1) / (s * rho_q)
    return content, rotary


def term_norms(model: Transformer, layer: int, head: int) -> dict[str, float]:
    """Frobenius norms of the content term A_h and of the rotary term's two sides (‖C_h‖, ‖D‖), with the ranks that
    bound each: what the head page lists beside the terms."""
    h = latent_head(model, layer, head)
    cfg = model.cfg
    return {
        "content_norm": float(h.content.norm()),
        "query_rotary_norm": float(torch.linalg.matrix_norm(h.query_rotary)),
        "key_rotary_norm": float(torch.linalg.matrix_norm(h.key_rotary)),
        "ov_norm": float(h.ov.norm()),
        "content_rank_bound": min(cfg.mla_d_nope, cfg.mla_kv_rank or 0, cfg.mla_q_rank or cfg.d_model),
        "rotary_rank_bound": cfg.rotary_dim or 0,
        "ov_rank_bound": min(cfg.mla_d_v, cfg.mla_kv_rank or 0),
        "kv_rank": cfg.mla_kv_rank or 0,
    }
