"""Hugging Face BLOOM and MPT checkpoints: ALiBi models (alibi.py), converted to TransformerLens names and shapes.

BLOOM (`model_type: bloom`): LayerNorms with biases, biases everywhere, tied embeddings, tanh-GELU MLP,
    word_embeddings_layernorm on the embeddings (applied here to every row of W_E: it acts on each token's
    embedding alone, so LN(W_E)[t] is exactly what the stream starts with), and a fused
    self_attention.query_key_value [3 d, d] interleaved per head: rows (n_heads, 3, d_head), like GPT-NeoX.
MPT (`model_type: mpt`): no biases (no_bias), LayerNorms without bias, exact GELU, tied embeddings, and a fused
    attn.Wqkv [3 d, d] whose rows are the q, k and v blocks in turn; attn_config.softmax_scale (default
    d_head^-1/2) and alibi_bias_max (the slopes).
Slopes: BLOOM's rule and MPT's (alibi.py), which differ when the head count is not a power of two. Read with the
Llama family's reader (llama.py: memory-mapped, tensor by tensor). Refused by name: BLOOM's
apply_residual_connection_post_layernorm, MPT without ALiBi (learned positions), clip_qkv, qk_ln, logit_scale,
prefix_lm, a norm_type other than LayerNorm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from circuits_core.errors import CheckpointError
from circuits_core.formats.hf import _bos, _config
from circuits_core.formats.llama import _T, Loaded, State, _Shards, single_threaded, take_unembedding
from circuits_core.model.config import ModelConfig
from circuits_core.model.config_reader import ConfigReader

ALIBI_MODEL_TYPES = ("bloom", "mpt")


def alibi_config(hf: dict[str, Any]) -> ModelConfig:
    path = Path("config.json")
    r = ConfigReader(hf, path.name)
    kind = r.text("model_type")
    if kind == "bloom":
        if r.flag("apply_residual_connection_post_layernorm", default=False):
            raise CheckpointError(f"{path.name}: apply_residual_connection_post_layernorm=true is not supported")
        d, H, L = r.integer("hidden_size", ge=1), r.integer("n_head", ge=1), r.integer("n_layer", ge=0)
        fields: dict[str, Any] = dict(
            n_ctx=r.integer("seq_length", default=2048, ge=1), act_fn="gelu_new", use_bias=True, alibi="bloom"
        )
    elif kind == "mpt":
        a = r.section("attn_config")
        for name, bad in (("alibi", not a.flag("alibi", default=False)), ("clip_qkv", a.has("clip_qkv")),
                          ("qk_ln", a.flag("qk_ln", default=False)), ("prefix_lm", a.flag("prefix_lm", default=False)),
                          ("logit_scale", r.has("logit_scale")),
                          ("norm_type", r.text("norm_type", default="low_precision_layernorm")
                           not in ("layernorm", "low_precision_layernorm"))):  # fmt: skip
            if bad:
                raise CheckpointError(f"{path.name}: {name}={a.data.get(name, r.data.get(name))!r} is not supported")
        if not r.flag("no_bias", default=True):
            raise CheckpointError(f"{path.name}: no_bias=false is not supported (MPT's released models have none)")
        d, H, L = r.integer("d_model", ge=1), r.integer("n_heads", ge=1), r.integer("n_layers", ge=0)
        scale = a.number("softmax_scale", default=None, gt=0)
        fields = dict(
            n_ctx=r.integer("max_seq_len", ge=1), act_fn="gelu", use_bias=False, alibi="mpt",
            alibi_bias_max=a.number("alibi_bias_max", default=8.0, gt=0), attn_scale=1 / scale if scale else None,
            d_mlp=d * r.integer("expansion_ratio", default=4, ge=1),
        )  # fmt: skip
    else:
        raise CheckpointError(f"{path.name}: model_type {kind!r} is not one of {', '.join(ALIBI_MODEL_TYPES)}")
    if d % H:
        raise CheckpointError(f"{path.name}: the width {d} is not divisible by the {H} heads")
    d_vocab = r.integer("vocab_size", ge=1)
    return _config(
        path, n_layers=L, d_model=d, n_heads=H, d_head=d // H, d_vocab=d_vocab, d_mlp=fields.pop("d_mlp", 4 * d),
        attn_only=False, normalization_type="LN", positional_embedding_type="none",
        eps=r.number("layer_norm_epsilon", default=1e-5, gt=0), bos_token_id=_bos(r, d_vocab), **fields,
    )  # fmt: skip


@single_threaded
def load_alibi(folder: Path, hf: dict[str, Any], dtype: torch.dtype) -> Loaded:
    """(config, TransformerLens state dict in `dtype`, tensor -> shard file, weight files)."""
    cfg = alibi_config(hf)
    src = _Shards(folder, dtype)
    bloom = cfg.alibi == "bloom"
    d, H, dh, V, m = cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_vocab, cfg.d_mlp or 0
    t = "transformer."
    embed = src.take(f"{t}word_embeddings.weight" if bloom else f"{t}wte.weight", (V, d))
    sd: State = {}
    if bloom:  # the embedding LayerNorm, row by row (exact: it sees one token's embedding at a time)
        w, b = (
            src.take(f"{t}word_embeddings_layernorm.weight", (d,)),
            src.take(f"{t}word_embeddings_layernorm.bias", (d,)),
        )
        sd["embed.W_E"] = F.layer_norm(embed, (d,), w, b, cfg.eps)
    else:
        sd["embed.W_E"] = embed

    def norm(key: str, ln: str) -> None:
        sd[f"{ln}.w"] = src.take(f"{key}.weight", (d,))
        sd[f"{ln}.b"] = src.take(f"{key}.bias", (d,)) if bloom else torch.zeros(d, dtype=dtype)

    for layer in range(cfg.n_layers):
        p = f"blocks.{layer}"
        if bloom:
            h = f"{t}h.{layer}"
            norm(f"{h}.input_layernorm", f"{p}.ln1")
            norm(f"{h}.post_attention_layernorm", f"{p}.ln2")
            qkv = src.take(f"{h}.self_attention.query_key_value.weight", (3 * d, d))  # rows (H, 3, dh)
            qkv_b = src.take(f"{h}.self_attention.query_key_value.bias", (3 * d,)).view(H, 3, dh)
            W = qkv.view(H, 3, dh, d)
            for i, x in enumerate("QKV"):
                sd[f"{p}.attn.W_{x}"] = W[:, i].transpose(1, 2).contiguous()  # [H, d, dh]
                sd[f"{p}.attn.b_{x}"] = qkv_b[:, i].contiguous()
            attn_o, mlp_in, mlp_out = "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"
        else:
            h = f"{t}blocks.{layer}"
            norm(f"{h}.norm_1", f"{p}.ln1")
            norm(f"{h}.norm_2", f"{p}.ln2")
            qkv = src.take(f"{h}.attn.Wqkv.weight", (3 * d, d)).view(3, H, dh, d)  # rows: q, k, v blocks
            for i, x in enumerate("QKV"):
                sd[f"{p}.attn.W_{x}"] = qkv[i].transpose(1, 2).contiguous()
            attn_o, mlp_in, mlp_out = "attn.out_proj", "ffn.up_proj", "ffn.down_proj"
        sd[f"{p}.attn.W_O"] = src.take(f"{h}.{attn_o}.weight", (d, d), lambda W: W.T.reshape(H, dh, d))
        sd[f"{p}.mlp.W_in"] = src.take(f"{h}.{mlp_in}.weight", (m, d), _T)  # [d_model, d_mlp]
        sd[f"{p}.mlp.W_out"] = src.take(f"{h}.{mlp_out}.weight", (d, m), _T)  # [d_mlp, d_model]
        if bloom:
            sd[f"{p}.attn.b_O"] = src.take(f"{h}.{attn_o}.bias", (d,))
            sd[f"{p}.mlp.b_in"] = src.take(f"{h}.{mlp_in}.bias", (m,))
            sd[f"{p}.mlp.b_out"] = src.take(f"{h}.{mlp_out}.bias", (d,))
    norm(f"{t}ln_f" if bloom else f"{t}norm_f", "ln_final")
    tied = ConfigReader(hf).flag("tie_word_embeddings", default=True)
    sd["unembed.W_U"] = take_unembedding(src, folder, embed, tied)  # the embedding as stored (before its norm)
    if bloom:
        sd["unembed.b_U"] = torch.zeros(V, dtype=dtype)
    src.finish()
    return cfg, sd, dict(src.where), src.files
