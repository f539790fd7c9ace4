"""Rotary QK circuits: the QK circuit at a query-key offset and the positional kernel (per band: rotary_bands.py).

Paper section: "The QK circuit" (Elhage et al. 2021; docs/maths.md §2.4, §2.6, 2.8) for models with rotary
positions (docs/maths.md §6). Row-vector convention (`x @ W`). `model.rotate(x, p)` is x R(p), the row x
rotated as the model rotates queries and keys at position p (its layout: rotate-half or adjacent pairs,
partial rotary, rope scaling), and R(a) R(b)^T = R(a - b). For the query at position i and the key at j,
δ = i - j, x̂ the ln1 output (norm gain included) and g = h // (n_heads / n_key_value_heads):

    score_h(i, j) = (x̂_i W_Q^h R(i)) . (x̂_j W_K^g R(j)) / s = x̂_i Ω_h(δ) x̂_j^T / s
    Ω_h(δ)        = W_Q^h R(δ) W_K^{gT}       [d_model, d_model], rank <= d_head (a FactoredMatrix)

(s = attn_scale; attention biases, absent in Llama-family models, are left out). TransformerLens's `QK` is
Ω_h(0). The full QK circuit at δ is W_E_eff Ω_h(δ) W_E_eff^T / s (circuits.py's W_E_eff), read through
rows, columns and global top-k, never dense; its nonzero eigenvalues are those of W_K^{gT} G_E W_Q^h R(δ) / s
(G_E = W_E_eff^T W_E_eff), whence the QK copying score at δ.

Positional kernel: f_h(δ) = μ_l Ω_h(δ) μ_l^T / s, μ_l the mean ln1 output entering layer l measured on a
reference text (REFERENCE_TEXT, first token left out: it is the attention sink, not typical text).

The energy per rotary band (Ω_h(δ) split over the rotation planes): rotary_bands.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.copying_spectra import copying_score, embed_gram, model_gram_cost
from circuits_core.circuits.embedding import embed_eff_matmul, embed_eff_rows
from circuits_core.circuits.factored import FactoredMatrix
from circuits_core.circuits.head_circuits import attention, check_head, factors_cost
from circuits_core.circuits.host_linalg import eigvals
from circuits_core.circuits.qk_forms import QKForm, folded_query_key, qk_form, token_factors, token_scale
from circuits_core.cost import Cost, float64_copy_size, itemsize
from circuits_core.errors import InvalidInputError
from circuits_core.model.flops import layers_flops
from circuits_core.model.latent_attention import LatentAttention
from circuits_core.model.qk_norm import qk_scale
from circuits_core.model.transformer import Transformer
from circuits_core.model.window import defined_offsets

# The reference text on which μ_l is measured (public domain: the opening of Lewis Carroll's "Alice's
# Adventures in Wonderland", 1865), tokenised with the model's tokenizer, BOS prepended when it has one.
REFERENCE_NAME = "Alice's Adventures in Wonderland, opening paragraphs (Lewis Carroll, 1865)"
REFERENCE_TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: "
    "once or twice she had peeped into the book her sister was reading, but it had no pictures or "
    'conversations in it, "and what is the use of a book," thought Alice "without pictures or '
    'conversations?" So she was considering in her own mind (as well as she could, for the hot day made her '
    "feel very sleepy and stupid), whether the pleasure of making a daisy-chain would be worth the trouble of "
    "getting up and picking the daisies, when suddenly a White Rabbit with pink eyes ran close by her. There "
    "was nothing so very remarkable in that; nor did Alice think it so very much out of the way to hear the "
    'Rabbit say to itself, "Oh dear! Oh dear! I shall be late!" (when she thought it over afterwards, it '
    "occurred to her that she ought to have wondered at this, but at the time it all seemed quite natural); "
    "but when the Rabbit actually took a watch out of its waistcoat-pocket, and looked at it, and then "
    "hurried on, Alice started to her feet, for it flashed across her mind that she had never before seen a "
    "rabbit with either a waistcoat-pocket, or a watch to take out of it, and burning with curiosity, she ran "
    "across the field after it, and fortunately was just in time to see it pop down a large rabbit-hole "
    "under the hedge. In another moment down went Alice after it, never once considering how in the world "
    "she was to get out again."
)
# Offsets shown by default (kernel plot, kernel peak, composition profiles): δ = 0..KERNEL_WINDOW.
KERNEL_WINDOW = 64


def check_rotary(model: Transformer) -> None:
    if model.cfg.positional_embedding_type != "rotary":
        raise InvalidInputError(
            f"this analysis needs rotary positions; the model has {model.cfg.positional_embedding_type!r} positions"
        )


def check_offsets(model: Transformer, offsets: Sequence[int] | Tensor) -> Tensor:
    """Offsets as a 1-D int64 tensor, each an integer with |δ| < n_ctx (a query and a key inside the context)."""
    t = torch.as_tensor(offsets)
    if t.dim() == 0:
        t = t[None]
    if t.dim() != 1 or t.numel() == 0 or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise InvalidInputError(f"offsets must be a non-empty list of integers, got {offsets!r}")
    n_ctx = model.cfg.n_ctx
    if int(t.abs().max()) >= n_ctx:
        raise InvalidInputError(f"offsets must lie in (-{n_ctx}, {n_ctx}) (n_ctx = {n_ctx}), got {int(t.abs().max())}")
    return t.long()


def rotation(
    model: Transformer, offsets: Sequence[int] | Tensor, dtype: torch.dtype = torch.float64, layer: int | None = None
) -> Tensor:
    """R(δ) [n, d_head, d_head] for each offset: x R(δ) is the model's own rotation of the row x (model.rotate), with
    layer `layer`'s rope (a local layer's own base, ModelConfig.layer_rope; None: the global layers' rope)."""
    check_rotary(model)
    delta = check_offsets(model, offsets).to(model.device)
    dh = model.cfg.d_head
    eye = torch.eye(dh, dtype=torch.float64, device=model.device).expand(delta.numel(), dh, dh)
    return model.rotate(eye, delta[:, None], layer).to(dtype)  # rows of R(δ) = the rotated basis vectors


def query_key_weights(model: Transformer, layer: int, head: int) -> tuple[Tensor, Tensor]:
    """(W_Q^h, W_K^g) [d_model, d_head] each: the head's query weights and its key/value group's key weights, with the
    QK-norm gains folded in under QK-norm (the weight-level "bilinear" form, qk_forms.py)."""
    check_head(model, layer, head)
    W_Q, W_K = folded_query_key(model, layer)
    return W_Q[head], W_K[head // model.cfg.group_size]


# -- Ω and the full QK circuit at an offset ----------------------------------------------------------------
def omega(model: Transformer, layer: int, head: int, offsets: Sequence[int] | Tensor) -> FactoredMatrix:
    """Ω_h(δ) = W_Q^h R(δ) W_K^{gT} [n_offsets, d_model, d_model] (inner d_head), one per offset (under QK-norm
    W_Q Γ_q R(δ) Γ_k W_K^T: the "bilinear" form, per-token scales left out)."""
    W_Q, W_K = query_key_weights(model, layer, head)
    R = rotation(model, offsets, dtype=W_Q.dtype, layer=layer)  # [n, dh, dh]
    return FactoredMatrix(W_Q @ R, W_K.T)  # A [n, d, dh], B [dh, d]


@dataclass
class QKFactors:
    """The unrotated factors of a head's full QK circuit: W_E_eff W_Q^h / s and W_E_eff W_K^g [d_vocab, d_head]; under
    QK-norm with each token's own normalisation as row scalings (the exact "cosine" form, qk_forms.py)."""

    layer: int
    head: int
    query: Tensor  # [V, dh]
    key: Tensor  # [V, dh]
    form: QKForm = "exact"


def full_qk_factors(model: Transformer, layer: int, head: int, tokens: Tensor | None = None) -> QKFactors:
    """The factors on every token, or on `tokens` (ids [n]) only: those tokens' rows."""
    W_Q, W_K = query_key_weights(model, layer, head)
    if tokens is None:
        query, key = embed_eff_matmul(model, W_Q) / model.cfg.scale, embed_eff_matmul(model, W_K)
    else:
        W_E = embed_eff_rows(model, tokens)  # [n, d_model]
        query, key = W_E @ W_Q / model.cfg.scale, W_E @ W_K
    query, key = token_factors(model, layer, head, query, key, tokens)  # exact under QK-norm and latent attention
    return QKFactors(layer, head, query, key, qk_form(model, "token"))


def full_qk_circuit_at(
    model: Transformer,
    layer: int,
    head: int,
    offset: int,
    factors: QKFactors | None = None,
    tokens: Tensor | None = None,
) -> FactoredMatrix:
    """W_E_eff Ω_h(δ) W_E_eff^T / s [d_vocab, d_vocab] (inner d_head): rows the query token at position i,
    columns the key token at i - δ; entry [b, a] is the token part of hook_attn_scores at that offset. With `tokens`
    (ids [n], no `factors`): the [n, n] submatrix, its factors formed on those tokens only."""
    check_rotary(model)
    f = factors if factors is not None else full_qk_factors(model, layer, head, tokens)
    R = rotation(model, [offset], dtype=f.query.dtype, layer=layer)[0]  # [dh, dh]
    return FactoredMatrix(f.query @ R, f.key.T)


def full_qk_col_at(model: Transformer, layer: int, head: int, key_token: int, offset: int) -> Tensor:
    """Column a of the full QK circuit at δ [d_vocab]: every query token's score on key token a, δ back."""
    if isinstance(key_token, bool) or not isinstance(key_token, int) or not 0 <= key_token < model.cfg.d_vocab:
        raise InvalidInputError(f"token id must be an integer in [0, {model.cfg.d_vocab}), got {key_token!r}")
    if model.cfg.latent_attention:  # the exact token table's column (its factors carry each token's latent scales)
        return full_qk_circuit_at(model, layer, head, offset).cols([key_token])[0]
    W_Q, W_K = query_key_weights(model, layer, head)
    k = embed_eff_rows(model, [key_token]) @ W_K  # [1, dh]
    R = rotation(model, [offset], dtype=W_Q.dtype, layer=layer)[0]
    col = embed_eff_matmul(model, W_Q @ (R @ k.T))[:, 0] / model.cfg.scale  # [V]
    if model.cfg.qk_norm is None:
        return col
    return col * token_scale(model, layer, head, "query") * token_scale(model, layer, head, "key", [key_token])


def full_qk_row_at(model: Transformer, layer: int, head: int, query_token: int, offset: int) -> Tensor:
    """Row b of the full QK circuit at δ [d_vocab]: query token b's score on every key token, δ back."""
    if isinstance(query_token, bool) or not isinstance(query_token, int) or not 0 <= query_token < model.cfg.d_vocab:
        raise InvalidInputError(f"token id must be an integer in [0, {model.cfg.d_vocab}), got {query_token!r}")
    if model.cfg.latent_attention:  # the exact token table's row
        return full_qk_circuit_at(model, layer, head, offset).rows([query_token])[0]
    W_Q, W_K = query_key_weights(model, layer, head)
    q = (
        embed_eff_rows(model, [query_token]) @ W_Q @ rotation(model, [offset], dtype=W_Q.dtype, layer=layer)[0]
    )  # [1, dh]
    row = embed_eff_matmul(model, W_K @ q.T)[:, 0] / model.cfg.scale  # [V]
    if model.cfg.qk_norm is None:
        return row
    return row * token_scale(model, layer, head, "key") * token_scale(model, layer, head, "query", [query_token])


def _qk_small(model: Transformer, W_Q: Tensor, W_K: Tensor, G_E: Tensor | None) -> Tensor:
    """W_K^T G_E W_Q / s [..., d_head, d_head] (float64) for W_Q, W_K [..., d_model, d_head]: times R(δ), its
    eigenvalues are the nonzero ones of the full QK circuit W_E_eff W_Q R(δ) W_K^T W_E_eff^T / s."""
    G_E = (embed_gram(model) if G_E is None else G_E).double()  # [d, d]
    return W_K.double().transpose(-2, -1) @ (G_E @ W_Q.double()) / model.cfg.scale


def qk_eigenvalues_at(model: Transformer, offset: int, G_E: Tensor | None = None) -> Tensor:
    """[n_layers, n_heads, d_head] complex: the nonzero eigenvalues of each full QK circuit at offset δ,
    those of W_K^{gT} G_E W_Q^h R(δ) / s [d_head, d_head] (float64; each layer with its own rope; under QK-norm the
    weight-level "bilinear" form W_Q Γ_q R Γ_k W_K^T, qk_forms.py)."""
    check_rotary(model)
    G_E = embed_gram(model) if G_E is None else G_E
    out = []
    for layer in range(model.cfg.n_layers):
        W_Q, W_K = folded_query_key(model, layer)
        W_K = W_K.repeat_interleave(model.cfg.group_size, dim=0)  # per query head
        R = rotation(model, [offset], layer=layer)[0]  # [dh, dh] float64
        out.append(eigvals(_qk_small(model, W_Q, W_K, G_E) @ R))
    return torch.stack(out)


def head_qk_eigenvalues_at(
    model: Transformer, layer: int, head: int, offsets: Sequence[int] | Tensor, G_E: Tensor | None = None
) -> Tensor:
    """[n_offsets, d_head] complex: one head's full-QK eigenvalues at each offset (qk_eigenvalues_at for one head)."""
    check_rotary(model)
    W_Q, W_K = query_key_weights(model, layer, head)
    R = rotation(model, offsets, layer=layer)  # [n, dh, dh] float64
    return eigvals(_qk_small(model, W_Q, W_K, G_E) @ R)


def qk_copying_scores_at(model: Transformer, offset: int, G_E: Tensor | None = None) -> Tensor:
    """[n_layers, n_heads] eigenvalue positivity of every full QK circuit at offset δ (float64)."""
    return copying_score(qk_eigenvalues_at(model, offset, G_E))


# -- the positional kernel -----------------------------------------------------------------------------
def reference_means(model: Transformer, tokens: Tensor) -> Tensor:
    """μ [n_layers, d_model]: the mean ln1 output entering each layer over tokens[:, 1:] (float64)."""
    tokens = model.check_tokens(tokens)
    if tokens.shape[1] < 2:
        raise InvalidInputError("the reference text needs at least 2 tokens (the first is left out)")
    names = {f"blocks.{layer}.ln1.hook_normalized" for layer in range(model.cfg.n_layers)}
    names |= {f"blocks.{layer}.hook_resid_pre" for layer in range(model.cfg.n_layers)}
    with torch.no_grad():  # stop at the last layer's pattern: no last MLP, final norm or unembedding
        cache = model.run_until(tokens, f"blocks.{model.cfg.n_layers - 1}.attn.hook_pattern", names=names)
    means = []
    for layer in range(model.cfg.n_layers):
        x = cache.get(f"blocks.{layer}.ln1.hook_normalized", cache[f"blocks.{layer}.hook_resid_pre"])  # no norm
        means.append(x[:, 1:].double().mean(dim=(0, 1)))
    return torch.stack(means)  # [L, d]


def positional_kernel(model: Transformer, means: Tensor, offsets: Sequence[int] | Tensor) -> Tensor:
    """f_h(δ) = μ_l Ω_h(δ) μ_l^T / s for every head and offset: [n_layers, n_heads, n_offsets] (float64), each layer
    with its own rope. Under QK-norm the kernel is the score the layer gives a query and a key both equal to μ_l, with
    μ_l's own normalisation (the "cosine" form, qk_forms.py), and under multi-head latent attention with μ_l's own
    latent scales (content term / ρ_q ρ_kv, rotary term / ρ_q: the "latent-token" form). On a local layer the offsets
    at or beyond its window are computed but never attended: `kernel_defined` says which are."""
    check_rotary(model)
    cfg = model.cfg
    if means.shape != (cfg.n_layers, cfg.d_model):
        raise InvalidInputError(
            f"means must be [n_layers, d_model] = [{cfg.n_layers}, {cfg.d_model}], got {tuple(means.shape)}"
        )
    delta = check_offsets(model, offsets).to(model.device)  # [n]
    out = torch.empty(cfg.n_layers, cfg.n_heads, delta.numel(), dtype=torch.float64, device=model.device)
    for layer in range(cfg.n_layers):
        mu = means[layer].double()
        W_Q, W_K = (W.double() for W in folded_query_key(model, layer))  # [H, d, dh], [n_kv, d, dh]
        q, k = mu @ W_Q, mu @ W_K  # [H, dh], [n_kv, dh]
        if cfg.qk_norm is not None:  # μ's own normalisation, measured on the unfolded projections
            rho_q, rho_k = (
                qk_scale(mu @ W.double(), cfg)
                for W in (attention(model, layer).W_Q, attention(model, layer).grouped("W_K"))
            )
            q, k = q / rho_q, k / rho_k
        attn = attention(model, layer)
        if isinstance(attn, LatentAttention):  # μ's own latent scales: q / ρ_q(μ), the key's content dims / ρ_kv(μ)
            rho_q, rho_kv = (r.double() for r in attn.latent_rho(mu[None].to(attn.W_DKV.dtype)))  # [1] each
            q, k = q / rho_q, attn.scale_keys(k, rho_kv)  # k [H, dh]: one token, μ
        k = k.repeat_interleave(cfg.group_size, dim=0)  # [H, dh]: each head's group key
        qR = model.rotate(q[:, None, :].expand(cfg.n_heads, delta.numel(), cfg.d_head), delta, layer)  # [H, n, dh]
        out[layer] = (qR * k[:, None, :]).sum(-1) / cfg.scale  # q R(δ) k^T
    return out


def kernel_defined(model: Transformer, offsets: Sequence[int] | Tensor) -> Tensor:
    """[n_layers, n_offsets] bool: the offsets each layer attends at (δ >= 0, and δ < its window on a local layer)."""
    delta = check_offsets(model, offsets).to(model.device)
    return torch.stack([defined_offsets(model.cfg, layer, delta) for layer in range(model.cfg.n_layers)])


def kernel_peaks(kernel: Tensor, offsets: Tensor, defined: Tensor | None = None) -> Tensor:
    """[L, H] the offset at which each head's kernel [L, H, n] is largest (first one on ties), among the offsets
    `defined` [L, n] marks (kernel_defined; all when None)."""
    if defined is not None:
        kernel = kernel.masked_fill(~defined[:, None, :].to(kernel.device), float("-inf"))
    return offsets.to(kernel.device)[kernel.argmax(dim=-1)]


def kernel_peak_offsets(model: Transformer, means: Tensor, window: int = KERNEL_WINDOW) -> Tensor:
    """[L, H] each head's kernel peak offset over δ = 0..window (clipped to n_ctx - 1; on a local layer to the offsets
    it attends), μ = means [L, d_model]."""
    offsets = torch.arange(min(window, model.cfg.n_ctx - 1) + 1)
    return kernel_peaks(positional_kernel(model, means, offsets), offsets, kernel_defined(model, offsets))


# -- costs (circuits_core.cost) ------------------------------------------------------------------------
def qk_copying_at_cost(model: Transformer, n_offsets: int) -> Cost:
    """head_qk_eigenvalues_at: R(δ) [n_offsets, d_head, d_head] in float64 (made with two such of temporaries), then
    beside it the vocabulary Gram G_E (copying_spectra.model_gram_cost), its float64 copy (beside it unless float64)
    with the float64 d_model x d_head products, then the d_head x d_head product per offset and its eigenvalues;
    answer: d_head complex eigenvalues at one offset and one score per offset."""
    cfg, size = model.cfg, itemsize(model.W_E.dtype)
    d, dh = cfg.d_model, cfg.d_head
    R = n_offsets * dh * dh * 8
    small = d * d * (size + float64_copy_size(model.W_E.dtype)) + (3 * d * dh + dh * dh) * 8
    flops = 2 * d * d * dh + 2 * dh * d * dh + n_offsets * 2 * dh**3  # W_K^T (G_E W_Q), then times each R(δ)
    products = Cost(dh * dh * 8 + R + 2 * n_offsets * dh * 16, flops=flops)
    gram = model_gram_cost(model, unembed=False)
    return (
        Cost(2 * R)
        .then(Cost(R) + gram.then(Cost(small)).then(products))
        .with_answer(numbers=2 * dh + 2 * n_offsets + 1, labels=dh)  # {re, im} each
    )


def kernel_cost(model: Transformer, n_offsets: int, n_tokens: int) -> Cost:
    """reference_means on n_tokens (the cached ln1 outputs and residuals) then the kernel: R(δ) for each
    offset and q, k per head; answer: the offsets and one kernel value per offset. Rotary models (and ALiBi ones,
    whose kernel alibi_kernel.py computes at less than this price: no rotations). FLOPs: kernel_flops."""
    if model.cfg.alibi is None:
        check_rotary(model)
    cfg = model.cfg
    run = 2 * cfg.n_layers * n_tokens * cfg.d_model * itemsize(model.dtype) + factors_cost(model).peak_bytes
    kernel = (n_offsets * cfg.d_head**2 + 2 * cfg.n_layers * cfg.n_heads * (cfg.d_head + n_offsets)) * 8
    return Cost(run).then(Cost(kernel, flops=kernel_flops(model, n_tokens))).with_answer(numbers=2 * n_offsets + 1)


def kernel_flops(model: Transformer, n_tokens: int) -> int:
    """reference_means on n_tokens (every layer but the last whole; the last up to its pattern: its q, k and scores)
    then positional_kernel (μ_l through each layer's W_Q and W_K, twice under QK-norm for μ's own rho; the rotations
    are elementwise)."""
    cfg = model.cfg
    if cfg.n_layers == 0:
        return 0
    H, G, dh, d = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_model
    last = 2 * n_tokens * d * dh * (H + G) + 2 * H * n_tokens * n_tokens * dh
    means = layers_flops(cfg, 1, n_tokens, True, True, range(cfg.n_layers - 1)) + last
    return means + cfg.n_layers * 2 * d * dh * (H + G) * (2 if cfg.qk_norm is not None else 1)
