"""ALiBi GGUF files, as llama.cpp's converter writes them: BLOOM ("bloom") and MPT ("mpt"). Both have ALiBi
(alibi.py), LayerNorms, a fused QKV whose rows are q's, then k's, then v's, and a GELU MLP.

BLOOM: LayerNorms with biases, biases everywhere, a tanh-GELU MLP, and a LayerNorm on the embeddings.
    token_embd.weight [d_vocab, d], token_embd_norm.weight/bias [d] -> embed.W_E = LN(token_embd) (exact: the norm
                                                   sees one token's embedding at a time, as in alibi_families.py)
    output.weight (the converter's copy of the embedding; absent: tied) -> unembed.W_U, the un-normed embedding
    blk.l.attn_norm / ffn_norm / output_norm .weight/.bias          -> ln1, ln2, ln_final (w, b)
    blk.l.attn_qkv.weight [3 d, d] / .bias [3 d]: the converter reorders BLOOM's per-head (head, 3, d_head) rows
                                                   into q's rows, then k's, then v's -> W_Q, W_K, W_V, b_Q, b_K, b_V
    blk.l.attn_output.weight/.bias, ffn_up, ffn_down (+ biases)     -> W_O, b_O, W_in, b_in, W_out, b_out
MPT: no biases (MPT's no_bias; a LayerNorm bias the file has is read), exact GELU, tied embeddings; the tensors are
    BLOOM's without token_embd_norm, and attn_qkv is MPT's own Wqkv (already q, k, v).
    mpt.attention.max_alibi_bias    -> alibi_bias_max (MPT's slopes; the converter writes 0 for a model without
                                       ALiBi, which has learned positions: refused by name)
    mpt.attention.clamp_kqv         -> refused by name (clip_qkv)
    The converter does not write MPT's softmax_scale: the score scale is d_head^-1/2, as llama.cpp runs every MPT
    file and as MPT's default is (`Defaulted`).
llama.cpp computes the slopes from max_alibi_bias as 2^(-b h / H') and the odd powers of 2^(-b / 2H') for the heads
beyond H' = 2^floor(log2 H): for any b, exactly MPT's rule (alibi.py), and BLOOM's when b = 8.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from circuits_core.errors import CheckpointError, InvalidInputError
from circuits_core.formats.gguf_quants import dequantize_transposed
from circuits_core.formats.gguf_tensors import Metadata, Tensors
from circuits_core.model.config import ModelConfig

State = dict[str, Any]
BLOOM, MPT = "bloom", "mpt"
MPT_SCALE_SOURCE = (
    "MPT's attn_config.softmax_scale is not in GGUF files: d_head^-1/2, MPT's default and what llama.cpp's mpt "
    "graph uses"
)


def alibi_config(meta: Metadata, d_vocab: int, bos_token_id: int | None) -> tuple[ModelConfig, list[Any]]:
    """(ModelConfig, [(field, value, source)] defaulted) of a BLOOM or MPT file."""
    a = str(meta.get("general.architecture"))
    d, H = meta.int(f"{a}.embedding_length"), meta.int(f"{a}.attention.head_count")
    if H < 1 or d % H:
        raise CheckpointError(f"{meta.name}: embedding_length {d} is not divisible by head_count {H}")
    if meta.int(f"{a}.attention.head_count_kv", H) != H:
        raise CheckpointError(f"{meta.name}: {a}.attention.head_count_kv differs from head_count (not supported)")
    fields: dict[str, Any] = {"act_fn": "gelu_new", "use_bias": True, "alibi": BLOOM}
    defaulted: list[Any] = []
    if a == MPT:
        if meta.header.has(f"{a}.attention.clamp_kqv"):
            raise CheckpointError(f"{meta.name}: {a}.attention.clamp_kqv is set: MPT's clip_qkv is not supported")
        bias_max = meta.float(f"{a}.attention.max_alibi_bias")
        if bias_max <= 0:
            raise CheckpointError(
                f"{meta.name}: {a}.attention.max_alibi_bias={bias_max}: MPT without ALiBi (learned positions) is not "
                f"supported"
            )
        fields = {"act_fn": "gelu", "use_bias": False, "alibi": MPT, "alibi_bias_max": bias_max}
        defaulted.append(("attn_scale", math.sqrt(d // H), MPT_SCALE_SOURCE))
    try:
        cfg = ModelConfig(
            n_layers=meta.int(f"{a}.block_count"), d_model=d, n_heads=H, d_head=d // H, d_vocab=d_vocab,
            n_ctx=meta.int(f"{a}.context_length"), d_mlp=meta.int(f"{a}.feed_forward_length"), attn_only=False,
            normalization_type="LN", positional_embedding_type="none",
            eps=meta.float(f"{a}.attention.layer_norm_epsilon", 1e-5), bos_token_id=bos_token_id, **fields,
        )  # fmt: skip
    except (InvalidInputError, TypeError) as exc:
        raise CheckpointError(f"{meta.name}: {exc}") from exc
    return cfg, defaulted


def alibi_state(cfg: ModelConfig, tensors: Tensors) -> State:
    """TransformerLens state dict of a BLOOM or MPT GGUF (module docstring)."""
    d, H, dh, V, m = cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_vocab, cfg.d_mlp or 0
    bloom = cfg.alibi == BLOOM
    embed = tensors.need("token_embd.weight", (V, d))
    if bloom:
        norm_w, norm_b = tensors.need("token_embd_norm.weight", (d,)), tensors.need("token_embd_norm.bias", (d,))
        sd: State = {"embed.W_E": F.layer_norm(embed, (d,), norm_w, norm_b, cfg.eps)}
    else:
        sd = {"embed.W_E": embed}
    output = tensors.info("output.weight", (V, d), optional=True)
    sd["unembed.W_U"] = embed.T.contiguous() if output is None else dequantize_transposed(tensors.header, output)

    def norm(theirs: str, ours: str) -> None:  # MPT's LayerNorms have no bias (zeros unless the file has one)
        sd[f"{ours}.w"] = tensors.need(f"{theirs}.weight", (d,))
        has_bias = bloom or f"{theirs}.bias" in tensors.raw
        sd[f"{ours}.b"] = tensors.need(f"{theirs}.bias", (d,)) if has_bias else torch.zeros(d)

    norm("output_norm", "ln_final")
    for layer in range(cfg.n_layers):
        b, p = f"blk.{layer}", f"blocks.{layer}"
        norm(f"{b}.attn_norm", f"{p}.ln1")
        norm(f"{b}.ffn_norm", f"{p}.ln2")
        qkv = tensors.need(f"{b}.attn_qkv.weight", (3 * d, d)).view(3, H, dh, d)  # q's rows, k's, v's
        for i, x in enumerate("QKV"):
            sd[f"{p}.attn.W_{x}"] = qkv[i].transpose(1, 2).contiguous()  # [n_heads, d_model, d_head]
        sd[f"{p}.attn.W_O"] = tensors.need_transposed(f"{b}.attn_output.weight", (d, d)).view(H, dh, d)
        sd[f"{p}.mlp.W_in"] = tensors.need_transposed(f"{b}.ffn_up.weight", (m, d))  # [d_model, d_mlp]
        sd[f"{p}.mlp.W_out"] = tensors.need_transposed(f"{b}.ffn_down.weight", (d, m))  # [d_mlp, d_model]
        if bloom:
            qkv_b = tensors.need(f"{b}.attn_qkv.bias", (3 * d,)).view(3, H, dh)
            for i, x in enumerate("QKV"):
                sd[f"{p}.attn.b_{x}"] = qkv_b[i].contiguous()
            sd[f"{p}.attn.b_O"] = tensors.need(f"{b}.attn_output.bias", (d,))
            sd[f"{p}.mlp.b_in"] = tensors.need(f"{b}.ffn_up.bias", (m,))
            sd[f"{p}.mlp.b_out"] = tensors.need(f"{b}.ffn_down.bias", (d,))
    if bloom:
        sd["unembed.b_U"] = torch.zeros(V)
    tensors.finish()
    return sd
