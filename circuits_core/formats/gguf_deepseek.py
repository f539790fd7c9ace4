"""DeepSeek-V2 and DeepSeek-V3 GGUF files ("deepseek2", as llama.cpp's converter writes them): multi-head latent
attention (model/latent_attention.py) and DeepSeek's mixture of experts with shared experts (model/moe.py).

Metadata (deepseek2.*):
    attention.q_lora_rank (absent or 0: no query latent, as V2-Lite), attention.kv_lora_rank -> mla_q_rank, mla_kv_rank
    attention.key_length_mla, value_length_mla   -> d_nope + d_rope and d_v per head (files converted before
        llama.cpp's MLA rewrite have no _mla keys: key_length and value_length then hold them)
    rope.dimension_count -> rotary_dim (d_rope); the rope dims rotate in adjacent pairs (llama.cpp runs deepseek2
        with its NORM rope, and the converter does not permute rows: DeepSeek's own interleaved layout)
    rope.scaling.type "yarn", .factor, .original_context_length, .yarn_beta_fast/slow -> YaRN (rope.py);
        .yarn_log_multiplier = 0.1 mscale_all_dim: the softmax scale's mscale = 1 + yarn_log_multiplier ln(factor)
    leading_dense_block_count, feed_forward_length -> moe_dense_layers, d_mlp_dense
    expert_count, expert_used_count, expert_feed_forward_length -> num_experts, experts_per_token, d_mlp
    expert_gating_func (1 softmax: V2; 2 sigmoid: V3), expert_weights_norm, expert_weights_scale -> moe_scoring,
        moe_norm_topk, moe_routed_scale; expert_group_count, expert_group_used_count -> group-limited routing
        (groups ranked by their best expert under the softmax, their best two under the sigmoid, as transformers)
    expert_shared_count -> moe_shared_d_mlp = expert_shared_count x expert_feed_forward_length
Tensors, per layer blk.l (numpy shapes, x @ W after transposing nn.Linear's [d_out, d_in]):
    attn_q_a [q_rank, d] -> W_DQ; attn_q_a_norm [q_rank] -> q_latent_norm.w; attn_q_b [H (d_nope + d_rope), q_rank]
        (attn_q [.., d] without a query latent), each head's rows [nope | rope] -> W_UQ, W_QR
    attn_kv_a_mqa [kv_rank + d_rope, d] -> W_DKV, W_KR; attn_kv_a_norm [kv_rank] -> kv_latent_norm.w
    attn_k_b [H, kv_rank, d_nope] (the converter's transpose of kv_b_proj's key rows) -> W_UK as stored;
        attn_v_b [H, d_v, kv_rank] -> W_UV; older files: attn_kv_b [H (d_nope + d_v), kv_rank] as transformers'
    attn_output [d, H d_v] -> W_O (rows from d_v on zero)
    ffn_gate/ffn_up/ffn_down on the leading dense layers; then ffn_gate_inp and the merged ffn_*_exps
    (gguf_experts.py), exp_probs_b.bias [E] -> b_choice (V3's e_score_correction_bias), ffn_*_shexp -> W_shared_*
Values a file does not carry come from `Defaulted` entries, each with its source: the gating function of files
written before llama.cpp stored it (softmax, as llama.cpp assumes for deepseek2), and YaRN's cos/sin factor (1:
llama.cpp's deepseek2 graph cancels it, which is transformers' factor when mscale == mscale_all_dim, as in every
released DeepSeek config; a file whose source had them differ has lost that factor, in llama.cpp too).
Refused by name: other gating functions, the top-k renormalised under the softmax, rope scaling other than YaRN.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from circuits_core.errors import CheckpointError, InvalidInputError
from circuits_core.formats.deepseek import latent_fields
from circuits_core.formats.gguf_experts import SOFTMAX_GATING, take_experts
from circuits_core.formats.gguf_tensors import Metadata, Tensors
from circuits_core.model.config import ModelConfig
from circuits_core.schedule import split_loop

State = dict[str, Any]
DEEPSEEK2 = "deepseek2"
SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
SOURCES = {
    "moe_scoring": "deepseek2.expert_gating_func absent: softmax, as llama.cpp assumes for DeepSeek-V2 files written "
    "before the key existed",
    "yarn_attention_factor": "YaRN's cos/sin factor 1: llama.cpp's deepseek2 graph cancels it, which is transformers' "
    "attention factor when mscale == mscale_all_dim (every released DeepSeek config)",
    "rope_beta_fast": "YaRN beta_fast 32: transformers' and llama.cpp's default",
    "rope_beta_slow": "YaRN beta_slow 1: transformers' and llama.cpp's default",
}


def _rope_gain(meta: Metadata) -> float:
    """YaRN's cos/sin factor, squared (1 without YaRN): q_R and k_R each carry it, so it is folded into W_QR."""
    if meta.get(f"{DEEPSEEK2}.rope.scaling.type", "none") != "yarn":
        return 1.0
    return meta.float(f"{DEEPSEEK2}.rope.scaling.yarn_attn_factor", 1.0) ** 2


def _rope(meta: Metadata, a: str, d_rope: int, defaulted: list[Any]) -> tuple[dict[str, Any], float | None]:
    """(rope_scaling.rope_fields-style fields, yarn_log_mul or None)."""
    base = meta.float(f"{a}.rope.freq_base", 10000.0)
    scaling = meta.get(f"{a}.rope.scaling.type", "none")
    if scaling == "none":
        return {"rotary_base": base, "rope_type": "default"}, None
    if scaling != "yarn":
        raise CheckpointError(f"{meta.name}: rope scaling type {scaling!r} is not supported for {a} (yarn only)")
    fields: dict[str, Any] = {
        "rotary_base": base, "rope_type": "yarn", "rope_factor": meta.float(f"{a}.rope.scaling.factor"),
        "rope_original_max_position_embeddings": meta.int(f"{a}.rope.scaling.original_context_length"),
        "rope_truncate": True,  # llama.cpp's correction dims are whole dims, as transformers' DeepSeek default
    }  # fmt: skip
    for name, default in (("rope_beta_fast", 32.0), ("rope_beta_slow", 1.0)):
        key = f"{a}.rope.scaling.yarn_{name.removeprefix('rope_')}"
        fields[name] = meta.float(key) if meta.header.has(key) else default
        if not meta.header.has(key):
            defaulted.append((name, default, SOURCES[name]))
    if not meta.header.has(f"{a}.rope.scaling.yarn_attn_factor"):
        defaulted.append(("yarn_attention_factor", 1.0, SOURCES["yarn_attention_factor"]))
    fields["attn_scale"] = math.sqrt(d_rope) / _rope_gain(meta)
    log_mul = meta.float(f"{a}.rope.scaling.yarn_log_multiplier", 0.0)
    return fields, log_mul or None


def _moe(meta: Metadata, a: str, n_layers: int, defaulted: list[Any]) -> dict[str, Any]:
    """ModelConfig's MLP fields: dense layers only, or DeepSeek's experts after the leading dense layers."""
    dense = meta.int(f"{a}.feed_forward_length")
    n_experts = meta.int(f"{a}.expert_count", 0)
    first_dense = meta.int(f"{a}.leading_dense_block_count", 0)
    if not n_experts or first_dense >= n_layers:
        return {"d_mlp": dense}
    gating = meta.get(f"{a}.expert_gating_func")
    if gating is None:
        defaulted.append(("moe_scoring", "softmax", SOURCES["moe_scoring"]))
        gating = SOFTMAX_GATING
    if gating not in (SOFTMAX_GATING, SIGMOID_GATING):
        raise CheckpointError(f"{meta.name}: {a}.expert_gating_func={gating!r} is not supported (1 softmax, 2 sigmoid)")
    sigmoid = gating == SIGMOID_GATING
    norm = bool(meta.get(f"{a}.expert_weights_norm", False))
    if norm and not sigmoid:
        raise CheckpointError(f"{meta.name}: {a}.expert_weights_norm under the softmax gating is not supported")
    groups, kept = meta.int(f"{a}.expert_group_count", 0), meta.int(f"{a}.expert_group_used_count", 0)
    grouped = groups > 1
    m, shared = meta.int(f"{a}.expert_feed_forward_length"), meta.int(f"{a}.expert_shared_count", 0)
    return {
        "d_mlp": m, "num_experts": n_experts, "experts_per_token": meta.int(f"{a}.expert_used_count"),
        "moe_dense_layers": first_dense, "d_mlp_dense": dense if first_dense else None,
        "moe_scoring": "sigmoid" if sigmoid else "softmax", "moe_norm_topk": norm,
        "moe_n_groups": groups if grouped else None, "moe_topk_groups": kept if grouped else None,
        "moe_routed_scale": meta.float(f"{a}.expert_weights_scale", 1.0),
        "moe_shared_d_mlp": m * shared if shared else None,
    }  # fmt: skip


def deepseek_config(meta: Metadata, d_vocab: int, bos_token_id: int | None) -> tuple[ModelConfig, list[Any]]:
    """(ModelConfig, [(field, value, source)] defaulted) of a deepseek2 file (module docstring)."""
    a = DEEPSEEK2
    defaulted: list[Any] = []
    n_layers, d_rope = meta.int(f"{a}.block_count"), meta.int(f"{a}.rope.dimension_count")
    mla = meta.header.has(f"{a}.attention.key_length_mla")
    d_qk = meta.int(f"{a}.attention.key_length_mla" if mla else f"{a}.attention.key_length")
    d_v = meta.int(f"{a}.attention.value_length_mla" if mla else f"{a}.attention.value_length")
    if d_qk < d_rope:
        raise CheckpointError(f"{meta.name}: a head's key width {d_qk} is smaller than rope.dimension_count {d_rope}")
    rope, log_mul = _rope(meta, a, d_rope, defaulted)
    attention, _ = latent_fields(
        rope, d_nope=d_qk - d_rope, d_rope=d_rope, d_v=d_v, q_rank=meta.int(f"{a}.attention.q_lora_rank", 0) or None,
        kv_rank=meta.int(f"{a}.attention.kv_lora_rank"), mscale_log_mul=log_mul, interleaved=True,
    )  # fmt: skip
    try:
        cfg = ModelConfig(
            n_layers=n_layers, d_model=meta.int(f"{a}.embedding_length"),
            n_heads=meta.int(f"{a}.attention.head_count"), d_vocab=d_vocab, n_ctx=meta.int(f"{a}.context_length"),
            attn_only=False, normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True,
            act_fn="silu", eps=meta.float(f"{a}.attention.layer_norm_rms_epsilon", 1e-6), bos_token_id=bos_token_id,
            **attention, **_moe(meta, a, n_layers, defaulted),
        )  # fmt: skip
    except (InvalidInputError, TypeError) as exc:
        raise CheckpointError(f"{meta.name}: {exc}") from exc
    return cfg, defaulted


def deepseek_state(cfg: ModelConfig, tensors: Tensors) -> State:
    """TransformerLens state dict of a deepseek2 file (module docstring)."""
    d, V, rope_gain = cfg.d_model, cfg.d_vocab, _rope_gain(Metadata(tensors.header))
    W_E, W_U = tensors.embeddings(V, d, None)
    sd: State = {"embed.W_E": W_E, "unembed.W_U": W_U, "ln_final.w": tensors.need("output_norm.weight", (d,))}
    layers: list[State] = [{} for _ in range(cfg.n_layers)]

    def read_layer(part: slice) -> None:
        layer = part.start
        b, p, out = f"blk.{layer}", f"blocks.{layer}", layers[layer]
        out[f"{p}.ln1.w"] = tensors.need(f"{b}.attn_norm.weight", (d,))
        out[f"{p}.ln2.w"] = tensors.need(f"{b}.ffn_norm.weight", (d,))
        _take_attention(tensors, cfg, b, f"{p}.attn", rope_gain, out)
        m = cfg.layer_d_mlp(layer) or 0
        if not cfg.layer_has_experts(layer):  # a dense layer, d_mlp_dense wide
            out[f"{p}.mlp.W_gate"] = tensors.need_transposed(f"{b}.ffn_gate.weight", (m, d))  # [d_model, d_mlp]
            out[f"{p}.mlp.W_in"] = tensors.need_transposed(f"{b}.ffn_up.weight", (m, d))
            out[f"{p}.mlp.W_out"] = tensors.need_transposed(f"{b}.ffn_down.weight", (d, m))  # [d_mlp, d_model]
            return
        E = cfg.num_experts or 0
        take_experts(tensors, b, p, E, d, m, out)
        if cfg.moe_scoring == "sigmoid":
            out[f"{p}.mlp.b_choice"] = tensors.need(f"{b}.exp_probs_b.bias", (E,))
        if cfg.moe_shared_d_mlp is not None:
            s = cfg.moe_shared_d_mlp
            out[f"{p}.mlp.W_shared_gate"] = tensors.need_transposed(f"{b}.ffn_gate_shexp.weight", (s, d))
            out[f"{p}.mlp.W_shared_in"] = tensors.need_transposed(f"{b}.ffn_up_shexp.weight", (s, d))
            out[f"{p}.mlp.W_shared_out"] = tensors.need_transposed(f"{b}.ffn_down_shexp.weight", (d, s))

    split_loop(cfg.n_layers, 1, read_layer, "qkov-gguf-layers")  # as gguf.gguf_state: two threads, layer order
    for one in layers:
        sd.update(one)
    tensors.finish()
    return sd


def _take_attention(tensors: Tensors, cfg: ModelConfig, b: str, p: str, rope_gain: float, out: State) -> None:
    d, H, r_kv = cfg.d_model, cfg.n_heads, cfg.mla_kv_rank or 0
    d_nope, d_rope, d_v = cfg.mla_d_nope, cfg.rotary_dim or 0, cfg.mla_d_v
    d_qk = d_nope + d_rope
    if cfg.mla_q_rank is not None:
        r_q = cfg.mla_q_rank
        out[f"{p}.W_DQ"] = tensors.need_transposed(f"{b}.attn_q_a.weight", (r_q, d))  # [d_model, q_rank]
        out[f"{p}.q_latent_norm.w"] = tensors.need(f"{b}.attn_q_a_norm.weight", (r_q,))
        up = tensors.need(f"{b}.attn_q_b.weight", (H * d_qk, r_q))
    else:
        r_q = d
        up = tensors.need(f"{b}.attn_q.weight", (H * d_qk, d))
    heads = up.view(H, d_qk, r_q).transpose(1, 2)  # [H, q_rank, nope | rope]
    out[f"{p}.W_UQ"] = heads[..., :d_nope].contiguous()  # [H, q_rank, d_nope]
    out[f"{p}.W_QR"] = heads[..., d_nope:] * rope_gain  # [H, q_rank, d_rope]
    down = tensors.need_transposed(f"{b}.attn_kv_a_mqa.weight", (r_kv + d_rope, d))  # [d_model, latent | rope]
    out[f"{p}.W_DKV"], out[f"{p}.W_KR"] = down[:, :r_kv].contiguous(), down[:, r_kv:].contiguous()
    out[f"{p}.kv_latent_norm.w"] = tensors.need(f"{b}.attn_kv_a_norm.weight", (r_kv,))
    if f"{b}.attn_kv_b.weight" in tensors.raw:  # before llama.cpp's MLA rewrite: transformers' kv_b_proj
        kv = tensors.need(f"{b}.attn_kv_b.weight", (H * (d_nope + d_v), r_kv)).view(H, d_nope + d_v, r_kv)
        out[f"{p}.W_UK"] = kv[:, :d_nope].transpose(1, 2).contiguous()  # [H, kv_rank, d_nope]
        out[f"{p}.W_UV"] = kv[:, d_nope:].transpose(1, 2).contiguous()  # [H, kv_rank, d_v]
    else:
        out[f"{p}.W_UK"] = tensors.need(f"{b}.attn_k_b.weight", (H, r_kv, d_nope))  # [H, kv_rank, d_nope]
        out[f"{p}.W_UV"] = tensors.need_transposed(f"{b}.attn_v_b.weight", (H, d_v, r_kv))  # [H, kv_rank, d_v]
    W_O = torch.zeros(H, cfg.d_head, d)
    W_O[:, :d_v] = tensors.need_transposed(f"{b}.attn_output.weight", (d, H * d_v)).view(H, d_v, d)
    out[f"{p}.W_O"] = W_O  # [H, d_head, d_model], rows from d_v on zero
