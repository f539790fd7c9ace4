"""The effective embedding W_E_eff: W_E with the first layer's LayerNorm applied row by row, and its products.

Paper section (Elhage et al. 2021): "One-Layer Attn-Only Transformers" reads every full circuit through the token
embedding; with LayerNorm models the paper (and TransformerLens) fold the first layer's ln1 into it, row by row
(centre, divide by the RMS, then the LN weight and bias if the model has them). Row-vector convention:
W_E_eff [d_vocab, d_model], row t the normalised embedding of token t.

Exactness: W_E_eff is exact for first-layer inputs when positions are not in the residual stream (shortformer,
rotary, none). With standard positions the first LN reads W_E[t] + W_pos[p], so W_E_eff is an approximation (the
LN scale and centring of the sum are not those of W_E[t] alone).

W_E_eff is never needed whole by the spectra: its per-token statistics (EmbedNorm, float64, cached per weights
version) give any chunk of rows (`embed_rows`) or any product W_E_eff @ W (`embed_eff_matmul`) from the raw W_E.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from circuits_core.circuits.product_factor import ProductFactor
from circuits_core.cost import Cost, check_stop, itemsize
from circuits_core.errors import InvalidInputError
from circuits_core.model.half_products import HALF_DTYPES, half_matmul
from circuits_core.model.hooks import Recorder
from circuits_core.model.transformer import Block, LayerNorm, Transformer
from circuits_core.schedule import shared_chunks

EMBED_CHUNK = 4096  # rows of W_E normalised at a time, so LN temporaries stay ~ EMBED_CHUNK x d_model
# apply_ln_rows: the most bytes of one chunk's copy in the norm's compute width (float32 for bf16 rows, which the CPU's
# RMS norm upcasts, then squares: two such copies), so wide rows go in fewer rows at a time (d_model 8192: 512 rows)
LN_CHUNK_BYTES = 16 * 2**20


def first_norm(model: Transformer) -> LayerNorm:
    """Layer 0's ln1, the norm W_E_eff applies (the model must have a layer)."""
    block = model.blocks[0]
    assert isinstance(block, Block)
    return block.ln1


def unnormalised(model: Transformer) -> bool:
    """Whether W_E_eff is W_E itself: no layers, or a first layer that reads the raw stream (no norm; OLMo 2)."""
    return model.cfg.n_layers == 0 or first_norm(model).kind is None


def apply_ln_rows(ln: LayerNorm, X: Tensor) -> Tensor:
    """A model LayerNorm applied to each row of X [n, d_model] as if it were one residual vector.

    Long inputs (all of W_E) go in chunks of ln_chunk_rows rows, so LN temporaries stay small.
    """
    step = ln_chunk_rows(X.shape[-1], max(X.element_size(), 4))
    if X.shape[0] <= step:
        return ln(X[None], Recorder(None), None)[0]  # [n, d_model]
    out = torch.empty_like(X)
    for start in range(0, X.shape[0], step):
        out[start : start + step] = ln(X[None, start : start + step], Recorder(None), None)[0]
    return out


def ln_chunk_rows(d_model: int, width: int) -> int:
    """Rows apply_ln_rows normalises at once: EMBED_CHUNK, fewer where a chunk in the norm's compute width (`width`
    bytes per element) would exceed LN_CHUNK_BYTES."""
    return max(1, min(EMBED_CHUNK, LN_CHUNK_BYTES // (d_model * width)))


def embed_eff_rows(model: Transformer, tokens: Tensor | list[int] | slice, dtype: torch.dtype | None = None) -> Tensor:
    """W_E_eff[tokens] [n, d_model]: layer 0's ln1 applied to these rows of W_E (W_E without LN); `dtype`: the rows
    converted to it first (a half-precision model's rows normalised in its compute dtype, not rounded to bf16)."""
    W_E = model.W_E[tokens] if dtype is None else model.W_E[tokens].to(dtype)
    if unnormalised(model):
        return W_E
    return apply_ln_rows(first_norm(model), W_E)


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


def _norm_key(model: Transformer) -> tuple[object, ...]:
    """What embed_norm's statistics depend on: W_E, ln1's weights (each by storage, version, dtype and device), eps."""
    ln = first_norm(model)
    w, b = getattr(ln, "w", None), getattr(ln, "b", None)
    return (*_version(model.W_E), *_version(w), *_version(b), model.cfg.eps)


def embed_norm_kept(model: Transformer) -> bool:
    """Whether embed_norm's statistics of the model's current weights are kept (its next call forms nothing)."""
    hit = _embed_norms.get(model)
    return hit is not None and hit[0] == _norm_key(model)


def embed_norm(model: Transformer) -> EmbedNorm:
    """The cached EmbedNorm of the model (recomputed when W_E or ln1's weights change, in place or replaced)."""
    ln = first_norm(model)
    w, b = getattr(ln, "w", None), getattr(ln, "b", None)
    key = _norm_key(model)
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


def embed_rows(
    model: Transformer, take: Callable[[], slice | None] | None, reuse: bool = False
) -> Iterator[tuple[slice, Tensor]]:
    """W_E_eff in the row chunks [chunk, d_model] that `take` hands out (default: all, EMBED_CHUNK rows each; W_E's own
    rows, uncopied, for a model without a layer-0 norm). `reuse`: every chunk is written over the previous one (for a
    caller done with each chunk before it asks for the next)."""
    take = shared_chunks(model.cfg.d_vocab, EMBED_CHUNK) if take is None else take
    norm = None if unnormalised(model) else embed_norm(model)
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
    if unnormalised(model):
        return model.W_E
    return torch.cat([chunk for _, chunk in embed_rows(model, None)])


def embed_eff_matmul(model: Transformer, W: Tensor) -> Tensor:
    """W_E_eff @ W [d_vocab, n] for W [d_model, n], without materialising W_E_eff: with the cached statistics,
    diag(inv_scale) (W_E (w * W) - mean (w W)) + b W, one product with the raw W_E."""
    if unnormalised(model):
        return half_matmul(model.W_E, W)
    norm = embed_norm(model)
    W_w = W if norm.w is None else norm.w[:, None] * W  # [d_model, n]
    out = half_matmul(model.W_E, W_w)  # [d_vocab, n] (float32 from a half-precision W_E)
    if norm.mean is not None:
        out -= norm.mean[:, None] * W_w.sum(0)
    out *= norm.inv_scale[:, None]
    return out if norm.b is None else out + norm.b @ W


def embed_unformed(model: Transformer) -> bool:
    """Whether embed_eff_matmul on this model is one product and a row scaling (embed_product): full-precision
    weights, and no mean or bias in layer 0's norm (RMSNorm, or none)."""
    if model.W_E.dtype in HALF_DTYPES:
        return False
    if unnormalised(model):
        return True
    norm = embed_norm(model)
    return norm.mean is None and norm.b is None and norm.inv_scale.dtype == model.W_E.dtype


def embed_product(model: Transformer, W: Tensor) -> ProductFactor | None:
    """embed_eff_matmul(model, W) kept unformed (its form() is that product bit for bit), where embed_unformed says
    it is one product and a row scaling and W has W_E's dtype; else None."""
    if not embed_unformed(model) or W.dtype != model.W_E.dtype:
        return None
    if unnormalised(model):
        return ProductFactor(model.W_E, W)
    norm = embed_norm(model)
    return ProductFactor(model.W_E, W if norm.w is None else norm.w[:, None] * W, norm.inv_scale)


def embed_pos_basis(model: Transformer) -> Tensor:
    """TransformerLens's overcomplete input basis W_E_pos = cat([W_E_eff, W_pos]) [d_vocab + n_ctx, d_model].

    For a shortformer model, layer 0's query/key input at position p with token t is exactly
    W_E_pos[t] + W_pos[p] (rows t and d_vocab + p), so (e_t + e_{V+p}) W_E_pos W_QK W_E_pos^T (...)^T / s is
    the attention score (without biases).
    """
    if model.W_pos is None:
        raise InvalidInputError(
            f"W_E_pos needs learned positions (standard or shortformer), the model has "
            f"{model.cfg.positional_embedding_type!r}"
        )
    return torch.cat([embed_eff(model), model.W_pos])


# -- costs (circuits_core.cost) ------------------------------------------------------------------------
def ln_rows_cost(model: Transformer, n: int) -> Cost:
    """apply_ln_rows on n rows of W_E's dtype [n, d_model]: its result, and one chunk's norm temporaries, at most two
    [min(n, ln_chunk_rows), d_model] in the compute dtype (the CPU's RMS norm of bf16 rows squares a float32 copy of
    them; of float32 or float64 rows, squares the rows themselves; a LayerNorm's fused kernel makes only its result)."""
    d, width = model.cfg.d_model, itemsize(model.compute_dtype)
    return Cost(n * d * model.W_E.element_size() + 2 * min(n, ln_chunk_rows(d, width)) * d * width)


def embed_chunks_cost(model: Transformer, reuse: bool) -> Cost:
    """embed_rows' working memory: the statistics embed_norm keeps ([d_vocab] inverse scales and means in the compute
    dtype; formed on the model's first use through one float64 chunk [EMBED_CHUNK, d_model], priced while not kept),
    then the chunk handed out and the next one made beside it (a half-precision W_E's chunk normalised in the compute
    dtype, then rounded: that copy too; with `reuse`, a full-precision chunk is written over the previous one). Nothing
    for a model without a layer-0 norm (W_E's own rows)."""
    if unnormalised(model):
        return Cost(0)
    cfg, size, width = model.cfg, model.W_E.element_size(), itemsize(model.compute_dtype)
    chunk = min(EMBED_CHUNK, cfg.d_vocab) * cfg.d_model  # elements
    if model.W_E.dtype != model.compute_dtype:
        chunks = chunk * (2 * size + width)
    else:
        chunks = chunk * size * (1 if reuse else 2)
    forming = 0 if embed_norm_kept(model) else chunk * 8
    return Cost(2 * cfg.d_vocab * width + max(forming, chunks))


def embed_rows_cost(model: Transformer, n: int) -> Cost:
    """embed_eff_rows on n tokens (in W_E's dtype): the rows of W_E it gathers [n, d_model], then layer 0's norm on
    them (ln_rows_cost) beside them."""
    gathered = Cost(n * model.cfg.d_model * model.W_E.element_size())
    return gathered if unnormalised(model) else gathered + ln_rows_cost(model, n)
