"""Single-head circuits: the direct path, QK and OV circuits, skip-trigrams, copying scores, positional QK.

Paper sections (Elhage et al. 2021): "Zero-Layer Transformers" (direct path W_U W_E), "One-Layer
Attn-Only Transformers" (QK circuit W_E^T W_QK W_E, OV circuit W_U W_OV W_E, skip-trigrams, copying and
the eigenvalue analysis). See paper-math sections 2.2-2.8.

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

LayerNorm: W_E_eff is W_E with the first layer's ln1 applied row by row (centre, divide by the RMS, then
the LN weight and bias if the model has them), as the paper does for its one-layer skip-trigrams. It is
exact for first-layer inputs when positions are not in the residual stream (shortformer, rotary, none).
With standard positions the first LN reads W_E[t] + W_pos[p], so W_E_eff is an approximation (the LN scale
and centring of the sum are not those of W_E[t] alone). The direct path uses ln_final applied to W_E
rows instead. Circuits of later layers use the same W_E_eff: they describe the direct token -> head path
(the paper's one-layer terms), ignoring the LN scale at that layer. Attention biases are ignored (their
effect on the pattern is only the per-key term b_Q W_K^T x, paper-math 1.4).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.factored import DEFAULT_BUDGET_BYTES, FactoredMatrix, topk_global_cost
from circuits_core.cost import Cost, check_stop, shared_chunks
from circuits_core.errors import InvalidInputError, NotFoundError
from circuits_core.model.hooks import Recorder
from circuits_core.model.linear import affine
from circuits_core.model.transformer import Attention, Block, LayerNorm, Transformer

EMBED_CHUNK = 4096  # rows of W_E normalised at a time, so LN temporaries stay ~ EMBED_CHUNK x d_model


def check_head(model: Transformer, layer: int, head: int) -> None:
    cfg = model.cfg
    if not 0 <= layer < cfg.n_layers:
        raise NotFoundError(f"head L{layer}H{head} out of range: the model has {cfg.n_layers} layers")
    if not 0 <= head < cfg.n_heads:
        raise NotFoundError(f"head L{layer}H{head} out of range: the model has {cfg.n_heads} heads per layer")


def _check_token(model: Transformer, token: int) -> None:
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < model.cfg.d_vocab:
        raise InvalidInputError(f"token id must be an integer in [0, {model.cfg.d_vocab}), got {token!r}")


def _block(model: Transformer, layer: int) -> Block:
    block = model.blocks[layer]
    assert isinstance(block, Block)
    return block


def _attn(model: Transformer, layer: int) -> Attention:
    check_head(model, layer, 0)
    return _block(model, layer).attn


def apply_ln_rows(ln: LayerNorm, X: Tensor) -> Tensor:
    """A model LayerNorm applied to each row of X [n, d_model] as if it were one residual vector.

    Long inputs (all of W_E) go in chunks of EMBED_CHUNK rows, so LN temporaries stay small.
    """
    if X.shape[0] <= EMBED_CHUNK:
        return ln(X[None], Recorder(None), None)[0]  # [n, d_model]
    out = torch.empty_like(X)
    for start in range(0, X.shape[0], EMBED_CHUNK):
        out[start : start + EMBED_CHUNK] = ln(X[None, start : start + EMBED_CHUNK], Recorder(None), None)[0]
    return out


def embed_eff_rows(model: Transformer, tokens: Tensor | list[int] | slice) -> Tensor:
    """W_E_eff[tokens] [n, d_model]: layer 0's ln1 applied to these rows of W_E (W_E without LN)."""
    W_E = model.W_E[tokens]
    if model.cfg.n_layers == 0 or model.cfg.normalization_type is None:
        return W_E
    return apply_ln_rows(_block(model, 0).ln1, W_E)


@dataclass
class EmbedNorm:
    """Layer 0's ln1 on every row of W_E, kept as per-token statistics: W_E_eff[t] = (W_E[t] - mean_t) * inv_scale_t
    * w + b (mean 0 for RMS norms, w / b absent for the Pre variants). Formed once per model and weights version."""

    inv_scale: Tensor  # [d_vocab] 1 / sigma_t (1 / rms_t)
    mean: Tensor | None  # [d_vocab] row means of W_E (centred norms only)
    w: Tensor | None  # [d_model]
    b: Tensor | None  # [d_model]


_embed_norms: weakref.WeakKeyDictionary[Transformer, tuple[tuple[object, ...], EmbedNorm]] = weakref.WeakKeyDictionary()


def _version(t: Tensor | None) -> tuple[object, ...]:
    return () if t is None else (t.data_ptr(), t._version, t.dtype, t.device)


def embed_norm(model: Transformer) -> EmbedNorm:
    """The cached EmbedNorm of the model (recomputed when W_E or ln1's weights change, in place or replaced)."""
    ln = _block(model, 0).ln1
    w, b = getattr(ln, "w", None), getattr(ln, "b", None)
    key = (*_version(model.W_E), *_version(w), *_version(b), model.cfg.eps)
    hit = _embed_norms.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    with torch.no_grad():
        dtype = model.compute_dtype  # statistics kept in at least float32
        inv_scale = torch.empty(model.cfg.d_vocab, dtype=dtype, device=model.W_E.device)
        mean = torch.empty_like(inv_scale) if ln.centred else None
        # statistics in float64, one chunk at a time in one buffer (in place: a fresh float64 chunk per operation
        # took 0.30 s on GPT-2 small's vocabulary as a new process's first use, its page faults included; this,
        # 0.07 s there and 0.03 s once the process has its memory)
        buffer = torch.empty(
            min(EMBED_CHUNK, model.cfg.d_vocab), model.cfg.d_model, dtype=torch.float64, device=model.W_E.device
        )
        for start in range(0, model.cfg.d_vocab, EMBED_CHUNK):
            check_stop(what="LN(W_E) statistics")
            rows = model.W_E[start : start + EMBED_CHUNK]
            x = buffer[: len(rows)].copy_(rows)  # [chunk, d_model] float64
            if mean is not None:
                m = x.mean(-1, keepdim=True)
                mean[start : start + EMBED_CHUNK] = m[:, 0]
                x.sub_(m)
            inv_scale[start : start + EMBED_CHUNK] = (x.square_().mean(-1) + model.cfg.eps).rsqrt()
    norm = EmbedNorm(inv_scale, mean, None if w is None else w.detach(), None if b is None else b.detach())
    _embed_norms[model] = (key, norm)
    return norm


def _normalised(model: Transformer, norm: EmbedNorm, rows: slice, out: Tensor | None = None) -> Tensor:
    """W_E_eff[rows] [chunk, d_model] from the statistics `norm`: one new tensor (or `out`, a buffer reused chunk after
    chunk when it has the rows: a fresh 6 MiB tensor per chunk costs ~3 ms of page faults), then in place (a fresh
    temporary per operation cost ~2x the time on GPT-2's vocabulary)."""
    W_E = model.W_E[rows]  # [chunk, d_model], the weights themselves: never written
    buffer = out[: len(W_E)] if out is not None and len(out) >= len(W_E) else None  # too small: a fresh tensor
    scale = norm.inv_scale[rows, None]  # [chunk, 1]
    x = (
        torch.mul(W_E, scale, out=buffer)
        if norm.mean is None
        else torch.sub(W_E, norm.mean[rows, None], out=buffer).mul_(scale)
    )
    if norm.w is not None:
        x = x.mul_(norm.w) if norm.b is None else torch.addcmul(norm.b, x, norm.w, out=x)
    elif norm.b is not None:
        x = x.add_(norm.b)
    return x.to(model.W_E.dtype)  # [chunk, d_model]


def _embed_rows(
    model: Transformer, take: Callable[[], slice | None] | None, reuse: bool = False
) -> Iterator[tuple[slice, Tensor]]:
    """W_E_eff in the row chunks [chunk, d_model] that `take` hands out (default: all, EMBED_CHUNK rows each; W_E's own
    rows, uncopied, for a model without a layer-0 norm). `reuse`: every chunk is written over the previous one (for a
    caller done with each chunk before it asks for the next)."""
    take = shared_chunks(model.cfg.d_vocab, EMBED_CHUNK) if take is None else take
    norm = None if model.cfg.n_layers == 0 or model.cfg.normalization_type is None else embed_norm(model)
    buffer: Tensor | None = None
    while (rows := take()) is not None:
        check_stop(what="LN(W_E)")
        if norm is None:
            yield rows, model.W_E[rows]
            continue
        X = _normalised(model, norm, rows, buffer)
        # the largest chunk so far: later chunks are written into it (not for half-precision W_E, whose chunks are
        # normalised in float32 and rounded once: normalised inside a half-precision buffer they would round at
        # every step)
        if reuse and model.W_E.dtype == model.compute_dtype and (buffer is None or len(X) > len(buffer)):
            buffer = X
        yield rows, X


def embed_eff(model: Transformer) -> Tensor:
    """W_E_eff [d_vocab, d_model]: W_E with layer 0's ln1 applied row by row (W_E without LN)."""
    if model.cfg.n_layers == 0 or model.cfg.normalization_type is None:
        return model.W_E
    return torch.cat([chunk for _, chunk in _embed_rows(model, None)])


def embed_eff_matmul(model: Transformer, W: Tensor) -> Tensor:
    """W_E_eff @ W [d_vocab, n] for W [d_model, n], without materialising W_E_eff: with the cached statistics,
    diag(inv_scale) (W_E (w * W) - mean (w W)) + b W, one product with the raw W_E."""
    if model.cfg.n_layers == 0 or model.cfg.normalization_type is None:
        return model.W_E @ W
    norm = embed_norm(model)
    W_w = W if norm.w is None else norm.w[:, None] * W  # [d_model, n]
    out = model.W_E @ W_w  # [d_vocab, n]
    if norm.mean is not None:
        out -= norm.mean[:, None] * W_w.sum(0)
    out *= norm.inv_scale[:, None]
    return out if norm.b is None else out + norm.b @ W


def embed_pos_basis(model: Transformer) -> Tensor:
    """TransformerLens's overcomplete input basis W_E_pos = cat([W_E_eff, W_pos]) [d_vocab + n_ctx, d_model].

    For a shortformer model, layer 0's query/key input at position p with token t is exactly
    W_E_pos[t] + W_pos[p] (rows t and d_vocab + p), so (e_t + e_{V+p}) W_E_pos W_QK W_E_pos^T (...)^T / s is
    the attention score (without biases).
    """
    if model.W_pos is None:
        raise InvalidInputError(
            f"W_E_pos needs learned positions (standard or shortformer), the model has {model.cfg.positional_embedding_type!r}"
        )
    return torch.cat([embed_eff(model), model.W_pos])


# -- the circuits -------------------------------------------------------------------------------------
def direct_path(model: Transformer) -> FactoredMatrix:
    """W_E_eff @ W_U [d_vocab, d_vocab]: rows current token, columns next-token logit (the bigram term).

    With LayerNorm, W_E_eff here is ln_final applied to W_E rows (the zero-layer input to the unembedding).
    b_U and positional terms are not included.
    """
    W_E = model.W_E if model.cfg.normalization_type is None else apply_ln_rows(model.ln_final, model.W_E)
    return FactoredMatrix(W_E, model.W_U)


def qk_circuit(model: Transformer, layer: int, head: int) -> FactoredMatrix:
    """W_QK = W_Q @ W_K^T [d_model, d_model] (inner d_head): rows query-side residual, cols key-side."""
    check_head(model, layer, head)
    attn = _attn(model, layer)
    return FactoredMatrix(attn.W_Q[head], attn.W_K[head].T)


def ov_circuit(model: Transformer, layer: int, head: int) -> FactoredMatrix:
    """W_V @ W_O [d_model, d_model] (inner d_head): rows the residual read at the source, cols written."""
    check_head(model, layer, head)
    attn = _attn(model, layer)
    return FactoredMatrix(attn.W_V[head], attn.W_O[head])


def full_qk_circuit(model: Transformer, layer: int, head: int, tokens: Tensor | None = None) -> FactoredMatrix:
    """W_E_eff W_Q W_K^T W_E_eff^T / attn_scale [d_vocab, d_vocab]: rows query token, cols key token.

    Entry [b, a] is the attention score (as in hook_attn_scores) of a query token b on a key token a,
    token part only: positional and bias terms are not included. With `tokens` (ids [n]): the [n, n] submatrix
    of those rows and columns, its factors formed on those tokens only.
    """
    check_head(model, layer, head)
    attn = _attn(model, layer)
    if tokens is not None:
        W_E = embed_eff_rows(model, tokens)  # [n, d_model]
        return FactoredMatrix(W_E @ attn.W_Q[head] / model.cfg.scale, (W_E @ attn.W_K[head]).T)
    W_Q = embed_eff_matmul(model, attn.W_Q[head])  # [V, d_h]
    W_K = embed_eff_matmul(model, attn.W_K[head])  # [V, d_h]
    return FactoredMatrix(W_Q / model.cfg.scale, W_K.T)


def full_ov_circuit(model: Transformer, layer: int, head: int, tokens: Tensor | None = None) -> FactoredMatrix:
    """W_E_eff W_V W_O W_U [d_vocab, d_vocab]: rows source (attended) token, cols output logit.

    Entry [a, c] is how much attending to token a raises the logit of token c (ignoring the LayerNorms
    after the head). With `tokens` (ids [n]): the [n, n] submatrix of those rows and columns, its factors
    formed on those tokens only.
    """
    check_head(model, layer, head)
    attn = _attn(model, layer)
    if tokens is not None:
        return FactoredMatrix(embed_eff_rows(model, tokens) @ attn.W_V[head], attn.W_O[head] @ model.W_U[:, tokens])
    return FactoredMatrix(embed_eff_matmul(model, attn.W_V[head]), attn.W_O[head] @ model.W_U)


def full_ov_row(model: Transformer, layer: int, head: int, source_token: int) -> Tensor:
    """Row a of the full OV circuit [d_vocab]: the logit effect of attending to token a (one vector-matrix
    chain through the residual stream, no [V, d_head] factor)."""
    check_head(model, layer, head)
    _check_token(model, source_token)
    attn = _attn(model, layer)
    x = embed_eff_rows(model, [source_token])  # [1, d_model]
    return (((x @ attn.W_V[head]) @ attn.W_O[head]) @ model.W_U)[0]  # [V]


def direct_row(model: Transformer, token: int) -> Tensor:
    """Row `token` of the direct path [d_vocab] (ln_final on that one row of W_E, then W_U)."""
    _check_token(model, token)
    x = (
        model.W_E[[token]]
        if model.cfg.normalization_type is None
        else apply_ln_rows(model.ln_final, model.W_E[[token]])
    )
    return (x @ model.W_U)[0]  # [V]


def full_qk_col(model: Transformer, layer: int, head: int, key_token: int) -> Tensor:
    """Column a of the full QK circuit [d_vocab]: the score of every query token on key token a."""
    check_head(model, layer, head)
    _check_token(model, key_token)
    attn = _attn(model, layer)
    k = embed_eff_rows(model, [key_token]) @ attn.W_K[head]  # [1, d_h]
    return embed_eff_matmul(model, attn.W_Q[head] @ k.T)[:, 0] / model.cfg.scale  # [V]


# -- positional QK ----------------------------------------------------------------------------------
@dataclass
class PositionalQK:
    scores: Tensor  # [n, n] W_pos W_QK W_pos^T / s, rows query position, cols key position (unmasked)
    pattern: Tensor  # [n, n] causal row softmax of scores (zero above the diagonal)
    previous_token: float  # mean of pattern[i, i-1], i >= 1
    current_token: float  # mean of pattern[i, i]


def positional_qk(model: Transformer, layer: int, head: int, n: int | None = None) -> PositionalQK:
    """The position-position part of the attention scores and its causal pattern (paper-math 2.4).

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


# -- skip-trigrams -----------------------------------------------------------------------------------
@dataclass
class SkipTrigrams:
    """Skip-trigrams "source ... destination -> out" through one head, for one source token a.

    dest_tokens/dest_scores: the k query tokens b with the largest attention score qk[b, a] on key a
    (column a of the full QK circuit, real score units). Raw scores are not comparable across queries
    (only differences within a row set the pattern), so this ranking is the paper's "largest QK entries".
    out_tokens/out_scores: the k tokens c with the largest logit effect ov[a, c] (row a of the full OV).
    joint [k, k]: qk[b, a] * ov[a, c] for every (destination, out) pair -- a heuristic strength only, the
    paper defines no joint score. triples: (b, c, joint) sorted by joint, largest first.
    copying: whether a is among its own top-k out tokens. With `vocab` (token ids [n]) destinations and
    outs are ranked among those tokens only.
    """

    source: int
    dest_tokens: Tensor  # [k]
    dest_scores: Tensor  # [k]
    out_tokens: Tensor  # [k]
    out_scores: Tensor  # [k]
    joint: Tensor  # [k, k] rows destination, cols out
    triples: list[tuple[int, int, float]]
    copying: bool


def skip_trigrams(
    model: Transformer,
    layer: int,
    head: int,
    source_token: int,
    k: int = 10,
    vocab: Tensor | None = None,
    qk_col: Tensor | None = None,
) -> SkipTrigrams:
    """qk_col [d_vocab]: the QK column to rank destinations by instead of full_qk_col (rotary.skip_trigrams_at
    passes the column at an offset)."""
    n = model.cfg.d_vocab if vocab is None else vocab.numel()
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise InvalidInputError(f"k must be an integer in [1, {n}], got {k!r}")
    keep = slice(None) if vocab is None else vocab
    ids = torch.arange(model.cfg.d_vocab, device=model.W_E.device)[keep]  # [n]
    col = full_qk_col(model, layer, head, source_token) if qk_col is None else qk_col  # [V]
    dest_scores, dest = col[keep].topk(k)  # [k]
    out_scores, out = full_ov_row(model, layer, head, source_token)[keep].topk(k)  # [k]
    dest_tokens, out_tokens = ids[dest], ids[out]
    joint = dest_scores[:, None] * out_scores[None, :]  # [k, k]
    order = joint.flatten().argsort(descending=True)
    triples = [(int(dest_tokens[i // k]), int(out_tokens[i % k]), float(joint.flatten()[i])) for i in order.tolist()]
    return SkipTrigrams(
        source=source_token,
        dest_tokens=dest_tokens,
        dest_scores=dest_scores,
        out_tokens=out_tokens,
        out_scores=out_scores,
        joint=joint,
        triples=triples,
        copying=bool((out_tokens == source_token).any()),
    )


@dataclass
class HeadDump:
    """The largest entries of a head's full circuits over all token pairs (the paper's "head dump")."""

    ov_values: Tensor  # [k] full OV entries, largest first
    ov_source: Tensor  # [k] source (attended) token a
    ov_out: Tensor  # [k] output token c
    qk_values: Tensor  # [k] full QK entries (attention-score units), largest first
    qk_query: Tensor  # [k] query (destination) token b
    qk_key: Tensor  # [k] key (source) token a


def head_dump(
    model: Transformer, layer: int, head: int, k: int = 100, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> HeadDump:
    ov_v, ov_a, ov_c = full_ov_circuit(model, layer, head).topk_global(k, budget_bytes=budget_bytes)
    qk_v, qk_b, qk_a = full_qk_circuit(model, layer, head).topk_global(k, budget_bytes=budget_bytes)
    return HeadDump(ov_v, ov_a, ov_c, qk_v, qk_b, qk_a)


# -- copying: eigenvalues of every head through d_head x d_head matrices ------------------------------
GRAM_BLOCKS = 4  # column blocks of the symmetric G_E: the 10 of 16 blocks on and above the diagonal are formed


def _grams(
    model: Transformer, unembed: bool, embed: bool, take: Callable[[], slice | None] | None = None
) -> tuple[Tensor, Tensor]:
    """(G, G_E) [d_model, d_model] each (zeros where not asked) from one pass over the chunks of W_E_eff."""
    d = model.cfg.d_model
    edges = [d * i // GRAM_BLOCKS for i in range(GRAM_BLOCKS + 1)]
    blocks = [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b > a]
    G, G_E = (torch.zeros(d, d, dtype=model.W_E.dtype, device=model.W_E.device) for _ in range(2))
    for rows, X in _embed_rows(model, take, reuse=True):  # X [chunk, d], used up before the next chunk
        if unembed:  # (linear.affine: oneDNN's product, ~15 % faster here than MKL's accumulating addmm_)
            G += affine(model.W_U[:, rows], X)
        for a, b in blocks if embed else ():  # G_E[blk, a:] += X[:, blk]^T X[:, a:]: blocks on and above the diagonal
            G_E[a:b, a:].addmm_(X[:, a:b].T, X[:, a:])
    return G, G_E.triu() + G_E.triu(1).T  # G_E's upper triangle (diagonal blocks included) mirrored


def embed_grams(model: Transformer, take: Callable[[], slice | None] | None = None) -> tuple[Tensor, Tensor]:
    """(G = W_U @ W_E_eff, G_E = W_E_eff^T @ W_E_eff), each [d_model, d_model], from one pass over the chunks of
    W_E_eff (each chunk normalised once). G_E is symmetric: only its column blocks on and above the diagonal are
    formed (GRAM_BLOCKS = 4: 10 of 16 blocks), the rest is their mirror. `take`: only the vocabulary rows it hands
    out (cost.shared_chunks shared by several threads: their Grams add up to the whole)."""
    return _grams(model, unembed=True, embed=True, take=take)


def unembed_embed_gram(model: Transformer) -> Tensor:
    """G = W_U @ W_E_eff [d_model, d_model], formed once per model for all full OV spectra."""
    return _grams(model, unembed=True, embed=False)[0]


def embed_gram(model: Transformer) -> Tensor:
    """G_E = W_E_eff^T @ W_E_eff [d_model, d_model], formed once per model for all full QK spectra (upper blocks
    mirrored, as embed_grams)."""
    return _grams(model, unembed=False, embed=True)[1]


def _spectrum(M: Tensor) -> Tensor:
    # eig is ill-conditioned for non-symmetric matrices: solve the small ones in float64.
    return torch.linalg.eigvals(M.double())


def ov_eigenvalues(model: Transformer, G: Tensor | None = None) -> Tensor:
    """[n_layers, n_heads, d_head] complex: the nonzero eigenvalues of each full OV circuit.

    lambda(W_E W_V W_O W_U) \\ {0} = lambda(W_O (W_U W_E) W_V) = lambda(W_O G W_V), d_head x d_head.
    """
    G = unembed_embed_gram(model) if G is None else G  # [d, d]
    # layer by layer (no stacked [L, H, d, d_h] copies of W_V, W_O and G W_V: ~110 MiB of fresh pages on GPT-2 small)
    attns = [_attn(model, layer) for layer in range(model.cfg.n_layers)]
    # W_O G W_V [H, d_h, d_h] per layer, G W_V once per key/value head (shared by its group)
    return _spectrum(torch.stack([a.W_O @ a.per_head(G @ a.grouped("W_V")) for a in attns]))  # eig of [L, H, d_h, d_h]


def gram_queries(model: Transformer, G_E: Tensor | None = None) -> Tensor:
    """G_E W_Q [n_layers, n_heads, d_model, d_head]: the query side of every full QK circuit (qk_eigenvalues), which
    the K-composition positivities read too (qk_paths.k_composition_positivity)."""
    G_E = embed_gram(model) if G_E is None else G_E  # [d, d]
    cfg = model.cfg
    out = torch.empty(cfg.n_layers, cfg.n_heads, cfg.d_model, cfg.d_head, dtype=G_E.dtype, device=G_E.device)
    for layer in range(cfg.n_layers):  # into one tensor, layer by layer: no stacked copy of W_Q
        torch.matmul(G_E, _attn(model, layer).W_Q, out=out[layer])
    return out


def qk_eigenvalues(model: Transformer, G_E: Tensor | None = None, G_E_W_Q: Tensor | None = None) -> Tensor:
    """[n_layers, n_heads, d_head] complex: nonzero eigenvalues of each full QK circuit (scaled by 1/s).

    lambda(W_E W_Q W_K^T W_E^T / s) \\ {0} = lambda(W_K^T (W_E^T W_E) W_Q) / s; G_E_W_Q: gram_queries when given.
    """
    GW_Q = gram_queries(model, G_E) if G_E_W_Q is None else G_E_W_Q  # [L, H, d, d_h]
    return _spectrum(
        torch.stack(
            [
                _attn(model, layer).W_K.transpose(-2, -1) @ GW_Q[layer]  # layer by layer: no stacked W_K
                for layer in range(model.cfg.n_layers)
            ]
        )
        / model.cfg.scale
    )  # eig of [L, H, d_h, d_h]


def copying_score(eigenvalues: Tensor) -> Tensor:
    """sum(lambda) / sum(|lambda|) over the last axis, in [-1, 1] (0 when every eigenvalue is 0)."""
    total = eigenvalues.abs().sum(-1)
    return torch.where(total > 0, eigenvalues.sum(-1).real / total.clamp_min(1e-300), 0.0)


def ov_copying_scores(model: Transformer, G: Tensor | None = None) -> Tensor:
    """[n_layers, n_heads] eigenvalue copying score of every full OV circuit (float64)."""
    return copying_score(ov_eigenvalues(model, G))


def qk_copying_scores(model: Transformer, G_E: Tensor | None = None, G_E_W_Q: Tensor | None = None) -> Tensor:
    """[n_layers, n_heads] eigenvalue positivity of every full QK circuit (same-token matching, float64)."""
    return copying_score(qk_eigenvalues(model, G_E, G_E_W_Q))


@dataclass
class CopyingMetrics:
    """The paper's alternative copying metrics for one head's full OV circuit M [V, V] (rows source a)."""

    diagonal_positive: float  # fraction of tokens a with M[a, a] > 0
    diagonal_quantiles: Tensor  # [5] quantiles 0, .25, .5, .75, 1 of the diagonal
    top1: float  # fraction of tokens a whose own logit is the largest in row a (ARENA top_1_acc)
    topk: float  # fraction of tokens a among the k largest of row a
    k: int


def ov_copying_metrics(
    model: Transformer, layer: int, head: int, k: int = 5, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> CopyingMetrics:
    """Diagonal sign fraction and top-1 / top-k accuracy of the full OV circuit, rows streamed in blocks."""
    return copying_metrics(full_ov_circuit(model, layer, head), k, budget_bytes)


def copying_metrics(M: FactoredMatrix, k: int = 5, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> CopyingMetrics:
    """The metrics of CopyingMetrics for any square token circuit M [n, n] (row i and column i: one token)."""
    if M.ldim != M.rdim:
        raise InvalidInputError(f"copying metrics need a square circuit, got {M.ldim} x {M.rdim}")
    if not 1 <= k <= M.rdim:
        raise InvalidInputError(f"k must be in [1, {M.rdim}], got {k}")
    diag = M.diag()  # [V]
    top1 = topk = 0
    for rows, block in M.iter_row_blocks(budget_bytes):  # block [b, V]
        check_stop(what="OV copying metrics")
        own = torch.arange(rows.start, rows.stop, device=block.device)
        top = block.topk(k, dim=-1).indices  # [b, k]
        top1 += int((top[:, 0] == own).sum())
        topk += int((top == own[:, None]).any(-1).sum())
    qs = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64)
    V = M.ldim
    return CopyingMetrics(
        diagonal_positive=float((diag > 0).double().mean()),
        diagonal_quantiles=torch.quantile(diag.double(), qs.to(diag.device)),
        top1=top1 / V,
        topk=topk / V,
        k=k,
    )


# -- costs (circuits_core.cost): priced before the computations above run ---------------------------------
def factors_cost(model: Transformer) -> Cost:
    """Building a full circuit's [d_vocab, d_head] factors (embed_eff_matmul: one LN chunk at a time)."""
    cfg, size = model.cfg, model.W_E.element_size()
    return Cost((2 * cfg.d_vocab * cfg.d_head + 2 * EMBED_CHUNK * cfg.d_model) * size)


def top_cost(model: Transformer, k: int, budget_bytes: int, line: bool, n_tokens: int | None = None) -> Cost:
    """A full circuit's top k: one row or column (`line`: [d_vocab] values), else topk_global over the
    n_tokens x n_tokens submatrix (default all tokens); answer: k (row token, column token, value)."""
    cfg, size = model.cfg, model.W_E.element_size()
    n = cfg.d_vocab if n_tokens is None else n_tokens
    if line:
        return factors_cost(model).then(Cost(3 * cfg.d_vocab * size)).with_answer(numbers=3 * k, labels=2 * k)
    search = topk_global_cost(n, cfg.d_head, n, k, budget_bytes, size)
    return factors_cost(model) + search.with_answer(labels=2 * k)


def copying_cost(model: Transformer, k: int, budget_bytes: int) -> Cost:
    """ov_copying_metrics: the factors, one row block (at most budget_bytes) and its top-k indices."""
    cfg, size = model.cfg, model.W_E.element_size()
    rows = max(1, min(cfg.d_vocab, budget_bytes // max(1, cfg.d_vocab * size)))
    block = rows * cfg.d_vocab * size + rows * k * 8
    return (factors_cost(model) + Cost(block + cfg.d_vocab * (size + 8))).with_answer(numbers=12, labels=6)


def skip_trigrams_cost(model: Transformer, k: int, budget_bytes: int, token: bool) -> Cost:
    """skip_trigrams (a QK column and an OV row) after, without a token, the global top-1 source search."""
    cfg, size = model.cfg, model.W_E.element_size()
    lines = factors_cost(model).then(Cost(4 * cfg.d_vocab * size + k * k * (size + 8)))
    search = top_cost(model, 1, budget_bytes, line=False) if not token else Cost(0)
    return search.then(lines).with_answer(numbers=3 * k + 2 * k * k, labels=2 * k + 3 * k * k)


def head_spectra_cost(model: Transformer, n_positions: int) -> Cost:
    """One head's summary: OV/QK eigenvalues of every head (G_E W_Q [L, H, d_model, d_head], one layer's G W_V at a
    time), the two Grams, singular values, and positional_qk on n_positions (scores and pattern [n, n]); answer: 2
    complex spectra, 2 singular-value lists, the [n, n] pattern."""
    cfg, size = model.cfg, model.W_E.element_size()
    products = (cfg.n_layers + 1) * cfg.n_heads * cfg.d_model * cfg.d_head * size
    grams = (2 * cfg.d_model**2 + 2 * EMBED_CHUNK * cfg.d_model) * size
    positional = 3 * n_positions * max(n_positions, cfg.d_model) * size
    return Cost(products + grams + positional).with_answer(numbers=6 * cfg.d_head + n_positions**2, labels=10)
