"""The weights the circuits read: the gains that the forward pass keeps apart folded into them, labelled so.

Two gains multiply a head's weights after a per-token normalisation, so the forward pass cannot fold them (folding a
gain changes the RMS the norm divides by): QK-norm's gamma_q, gamma_k (qk_norm.py) and an output norm's gamma_post
(Gemma 2/3, OLMo 2/3: ln1_post, norm.py). The weight circuits fold them on the side of the projection, and leave the
per-token scalars (rho_q, rho_k, rho_post) out:
    W_Q Gamma_q, W_K Gamma_k       the weight-level QK form W_Q Gamma_q R Gamma_k W_K^T (qk_forms.py: "bilinear")
    W_O diag(gamma_post)           the OV circuit and every path through the head, exact up to the layer's per-token
                                   output scale 1 / rho_post(i) (frozen by the path expansions, prompt/frozen.py);
                                   an MLP's W_out likewise with its ln2_post gain
Without these features each weight is the model's own. `circuit_weight` reads one layer (K and V per key/value
group, as stored); `head_weights` one head; `stacked_weights` every layer, per query head.
"""

from __future__ import annotations

import torch
from torch import Tensor

from circuits_core.circuits.qk_forms import folded_query_key
from circuits_core.cost import float64_copy_size, itemsize
from circuits_core.model.transformer import Block, Transformer


def _block(model: Transformer, layer: int) -> Block:
    block = model.blocks[layer]
    assert isinstance(block, Block)
    return block


def circuit_weight(model: Transformer, layer: int, name: str) -> Tensor:
    """One layer's W_Q [H, d, dh], W_K / W_V [n_kv, d, dh] (per group, as stored) or W_O [H, dh, d], gains folded."""
    block = _block(model, layer)
    if name in ("W_Q", "W_K"):
        W_Q, W_K = folded_query_key(model, layer)
        return W_Q if name == "W_Q" else W_K
    if name == "W_V":
        return block.attn.grouped("W_V")
    if name == "W_O":
        W_O = block.attn.W_O
        return W_O * block.ln1_post.w if model.cfg.post_norms else W_O
    raise ValueError(f"no circuit weight {name!r}")


def read_copies(model: Transformer, *names: str) -> int:
    """Bytes of the new tensors circuit_weight makes for one layer's `names` (model dtype): a gain folded in (W_Q and
    W_K under QK-norm, W_O under output norms) or a weight formed from latent factors (multi-head latent attention);
    0 for the weights themselves."""
    cfg, size = model.cfg, itemsize(model.dtype)
    formed = {
        "W_Q": cfg.qk_norm is not None, "W_K": cfg.qk_norm is not None, "W_V": False, "W_O": cfg.post_norms
    }  # fmt: skip
    return sum(_heads(model, n) * cfg.d_model * cfg.d_head * size for n in names if formed[n] or cfg.latent_attention)


def float64_weights_bytes(model: Transformer, *names: str) -> int:
    """Bytes of one layer's `names` as circuit_weight returns them (read_copies) and of their float64 copies (none for
    a float64 model)."""
    cfg, wide = model.cfg, float64_copy_size(model.dtype)
    return read_copies(model, *names) + sum(_heads(model, n) * cfg.d_model * cfg.d_head * wide for n in names)


def _heads(model: Transformer, name: str) -> int:
    """The heads a layer's weight `name` has: n_heads for W_Q and W_O, n_kv_heads for W_K and W_V."""
    return model.cfg.n_heads if name in ("W_Q", "W_O") else model.cfg.n_kv_heads


def mlp_output_weight(model: Transformer, layer: int) -> Tensor:
    """W_out [d_mlp, d_model] of a layer's MLP, its output norm's gain (ln2_post) folded in."""
    block = _block(model, layer)
    return block.mlp.W_out * block.ln2_post.w if model.cfg.post_norms else block.mlp.W_out


def head_weights(model: Transformer, layer: int, head: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(W_Q, W_K, W_V [d, dh], W_O [dh, d]) of one head (its key/value group's K and V), gains folded: circuit_weight's
    rows of this head, each gain applied to this head's weights only (a layer's folds of Gemma-3's W_Q, W_K and W_O
    took 80 ms of a 120 ms OV row)."""
    group = head // model.cfg.group_size
    attn = _block(model, layer).attn
    W_Q, W_K, W_V, W_O = attn.W_Q[head], attn.grouped("W_K")[group], attn.grouped("W_V")[group], attn.W_O[head]
    if model.cfg.qk_norm is not None:  # gains [heads, d_head]: the query head's and the key/value head's rows
        W_Q, W_K = W_Q * attn.q_norm.gain()[head], W_K * attn.k_norm.gain()[group]
    if model.cfg.post_norms:
        W_O = W_O * _block(model, layer).ln1_post.w
    return W_Q, W_K, W_V, W_O


def layer_weights(model: Transformer, layer: int, name: str) -> Tensor:
    """[n_heads, ...] of a circuit weight of one layer per query head (K and V repeated over each group)."""
    W = circuit_weight(model, layer, name)
    return W.repeat_interleave(model.cfg.group_size, dim=0) if name in ("W_K", "W_V") else W


def stacked_weights(model: Transformer, name: str) -> Tensor:
    """[n_layers, n_heads, ...] of a circuit weight per query head (K and V repeated over each group)."""
    return torch.stack([layer_weights(model, layer, name) for layer in range(model.cfg.n_layers)])
