"""Hugging Face DeepSeek-V2 and DeepSeek-V3 checkpoints (`deepseek_v2`, `deepseek_v3`): multi-head latent attention
(model/latent_attention.py) and DeepSeek's mixture of experts (model/moe.py), read tensor by tensor as llama.py reads
its family. Per layer h = model.layers.{l}, row vectors after transposing nn.Linear's [d_out, d_in]:
    self_attn.q_a_proj [q_rank, d] -> W_DQ; q_a_layernorm [q_rank] -> q_latent_norm.w      (q_lora_rank set)
    self_attn.q_b_proj [H (d_nope + d_rope), q_rank] (or q_proj [.., d] without a query latent): each head's rows
        are [nope | rope] -> W_UQ [H, q_rank, d_nope], W_QR [H, q_rank, d_rope]
    self_attn.kv_a_proj_with_mqa [kv_rank + d_rope, d]: rows [latent | shared rotary key] -> W_DKV, W_KR
    self_attn.kv_a_layernorm [kv_rank] -> kv_latent_norm.w
    self_attn.kv_b_proj [H (d_nope + d_v), kv_rank]: each head's rows [k_nope | v] -> W_UK, W_UV
    self_attn.o_proj [d, H d_v] -> W_O [H, d_head, d] (rows from d_v on zero)
    mlp: the first first_k_dense_replace layers a gated MLP (intermediate_size); then mlp.gate [E, d] -> W_router,
        mlp.gate.e_score_correction_bias [E] -> b_choice (V3), mlp.experts.{e}.gate/up/down_proj (moe_intermediate_size)
        -> W_gate, W_in, W_out [E, ...], mlp.shared_experts.* (n_shared_experts x moe_intermediate_size) -> W_shared_*
Rotary: V2 and V3 with rope_interleave rotate adjacent pairs of the rope dims, V3 without it rotate halves. The
softmax scale is (d_nope + d_rope)^-½, times mscale(factor, mscale_all_dim)² under YaRN; YaRN's cos/sin factor reaches
only the rotary part (q_R and k_R each carry it), so its square is folded into W_QR. Routing: V2 softmax scores,
greedy or group-limited (group max); V3 sigmoid scores, choice biased by e_score_correction_bias, groups ranked by
their two best, weights renormalised when norm_topk_prob; both times routed_scaling_factor.
num_key_value_heads is not read: every head's key and value come from the one shared latent (released files
set it to num_attention_heads).
Block-scaled FP8 files (quantization_config quant_method "fp8", V3's release) are dequantised weight by weight as
transformers does (fp8.py). Refused by name: other quantisations, attention and MLP biases, topk methods other than
greedy / group_limited_greedy, and the rope types rope_scaling.py does not read. The num_nextn_predict_layers
multi-token-prediction layers after the last (model.layers.{num_hidden_layers}.* ...) are not part of the causal
model: they are not read.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuits_core.errors import CheckpointError
from circuits_core.formats.fp8 import dequantize_fp8, scale_grid
from circuits_core.formats.hf import _act_fn, _bos, _config
from circuits_core.formats.llama import _T, Loaded, State, _Shards, laid_out, single_threaded, take_unembedding
from circuits_core.formats.rope_scaling import rope_fields, rope_section
from circuits_core.model.config import ModelConfig
from circuits_core.model.config_reader import ConfigReader

DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
TOPK_METHODS = ("greedy", "group_limited_greedy")


def fp8_block(r: ConfigReader) -> tuple[int, int] | None:
    """The block of block-scaled FP8 weights (quantization_config: quant_method "fp8", fmt e4m3, weight_block_size),
    None for unquantised files; other quantisations are refused by name."""
    q = r.section("quantization_config")
    method = q.text("quant_method", default=None)
    if method is None:
        return None
    fmt = q.text("fmt", default="e4m3")
    if method != "fp8" or fmt != "e4m3":
        raise CheckpointError(
            f"{r.source}: quantization_config quant_method {method!r} fmt {fmt!r} is not supported; supported: "
            "block-scaled FP8 (quant_method 'fp8', fmt 'e4m3')"
        )
    block = q.data.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and 1 <= b <= 1 << 16 for b in block)):
        raise CheckpointError(f"{r.source}: quantization_config.weight_block_size must be two positive integers")
    return block[0], block[1]


def _refuse_unhonoured(r: ConfigReader, model_type: str) -> None:
    name = r.source
    fp8_block(r)
    for flag in ("attention_bias", "mlp_bias"):
        if r.flag(flag, default=False):
            raise CheckpointError(f"{name}: {flag}=true is not supported for {model_type}")
    if model_type == "deepseek_v2":
        method = r.text("topk_method", default="greedy")
        if method not in TOPK_METHODS:
            raise CheckpointError(
                f"{name}: topk_method {method!r} is not supported; supported: {', '.join(TOPK_METHODS)}"
            )


def _moe_fields(r: ConfigReader, model_type: str, n_layers: int) -> dict[str, Any]:
    """ModelConfig's MLP fields: dense layers only, or DeepSeek's experts after the first first_k_dense_replace."""
    dense = r.integer("intermediate_size", ge=1)
    first_dense = r.integer("first_k_dense_replace", default=0, ge=0)
    experts = r.integer("n_routed_experts", default=None, ge=1)
    if experts is None or first_dense >= n_layers:
        return {"d_mlp": dense}
    v3 = model_type == "deepseek_v3"
    grouped = v3 or r.text("topk_method", default="greedy") == "group_limited_greedy"
    m = r.integer("moe_intermediate_size", ge=1)
    shared = r.integer("n_shared_experts", default=0, ge=0)
    return {
        "d_mlp": m, "num_experts": experts, "experts_per_token": r.integer("num_experts_per_tok", ge=1),
        "moe_dense_layers": first_dense, "d_mlp_dense": dense if first_dense else None,
        "moe_scoring": "sigmoid" if v3 else "softmax", "moe_norm_topk": v3 and r.flag("norm_topk_prob", default=True),
        "moe_n_groups": r.integer("n_group", ge=1) if grouped else None,
        "moe_topk_groups": r.integer("topk_group", ge=1) if grouped else None,
        "moe_routed_scale": r.number("routed_scaling_factor", default=1.0, gt=0),
        "moe_shared_d_mlp": m * shared if shared else None,
    }  # fmt: skip


def _attention_fields(r: ConfigReader, model_type: str) -> tuple[dict[str, Any], float]:
    """ModelConfig's attention fields and the factor folded into W_QR (YaRN's cos/sin factor, squared)."""
    d_nope, d_rope = r.integer("qk_nope_head_dim", ge=0), r.integer("qk_rope_head_dim", ge=2)
    rope = rope_section(r)
    all_dim = rope.number("mscale_all_dim", default=None, gt=0)
    return latent_fields(
        rope_fields(r, rope, d_head=d_rope), d_nope=d_nope, d_rope=d_rope, d_v=r.integer("v_head_dim", ge=1),
        q_rank=r.integer("q_lora_rank", default=None, ge=1), kv_rank=r.integer("kv_lora_rank", ge=1),
        mscale_log_mul=0.1 * all_dim if all_dim else None,
        interleaved=model_type == "deepseek_v2" or r.flag("rope_interleave", default=True),
    )  # fmt: skip


def latent_fields(
    rope: dict[str, Any], d_nope: int, d_rope: int, d_v: int, q_rank: int | None, kv_rank: int,
    mscale_log_mul: float | None, interleaved: bool,
) -> tuple[dict[str, Any], float]:  # fmt: skip
    """ModelConfig's MLA fields from the rope fields (rope_scaling.rope_fields': under YaRN its attn_scale carries
    the cos/sin factor) and the factor folded into W_QR (that factor, squared: it reaches only the rotary part).
    The softmax scale is (d_nope + d_rope)^-½, times mscale² under YaRN, mscale = 1 + mscale_log_mul ln(factor)
    (transformers' yarn_get_mscale(factor, mscale_all_dim): mscale_log_mul = 0.1 mscale_all_dim)."""
    fields = dict(rope)
    rope_gain = math.sqrt(d_rope) / fields.pop("attn_scale") if "attn_scale" in fields else 1.0
    scale = math.sqrt(d_nope + d_rope)
    if fields["rope_type"] != "default" and mscale_log_mul:
        factor = fields.get("rope_factor", 1.0)
        mscale = 1.0 if factor <= 1 else mscale_log_mul * math.log(factor) + 1.0
        scale /= mscale**2
    fields.update(
        mla_q_rank=q_rank, mla_kv_rank=kv_rank, mla_d_nope=d_nope, mla_d_v=d_v, d_head=max(d_nope + d_rope, d_v),
        rotary_dim=d_rope, rotary_adjacent_pairs=interleaved, attn_scale=scale,
    )  # fmt: skip
    return fields, rope_gain


def deepseek_config(hf: dict[str, Any]) -> ModelConfig:
    return _deepseek_config(hf)[0]


def _deepseek_config(hf: dict[str, Any]) -> tuple[ModelConfig, float]:
    path = Path("config.json")
    r = ConfigReader(hf, path.name)
    model_type = r.text("model_type")
    if model_type not in DEEPSEEK_MODEL_TYPES:
        raise CheckpointError(f"{path.name}: model_type {model_type!r} is not one of {', '.join(DEEPSEEK_MODEL_TYPES)}")
    _refuse_unhonoured(r, model_type)
    n_layers, d_vocab = r.integer("num_hidden_layers", ge=0), r.integer("vocab_size", ge=1)
    attention, rope_gain = _attention_fields(r, model_type)
    cfg = _config(
        path, n_layers=n_layers, d_model=r.integer("hidden_size", ge=1),
        n_heads=r.integer("num_attention_heads", ge=1), d_vocab=d_vocab,
        n_ctx=r.integer("max_position_embeddings", ge=1), attn_only=False, normalization_type="RMS",
        positional_embedding_type="rotary", gated_mlp=True, act_fn=_act_fn(r, "hidden_act", "silu"),
        eps=r.number("rms_norm_eps", default=1e-6, gt=0), bos_token_id=_bos(r, d_vocab),
        **attention, **_moe_fields(r, model_type, n_layers),
    )  # fmt: skip
    return cfg, rope_gain


def _heads(heads: int, rows: int, start: int, stop: int, cols: int) -> Any:
    """Rows [start, stop) of each head's block of `rows` in a [heads * rows, cols] weight, as [heads, cols, stop -
    start] (x @ W form)."""
    return lambda W: W.view(heads, rows, cols)[:, start:stop].transpose(1, 2)


@single_threaded
def load_deepseek(folder: Path, hf: dict[str, Any], dtype: torch.dtype) -> Loaded:
    """(config, state dict in `dtype`, tensor -> shard file, weight files)."""
    cfg, rope_gain = _deepseek_config(hf)
    src = _Shards(folder, dtype)
    w = _Linears(src, fp8_block(ConfigReader(hf)))
    d = cfg.d_model
    sd: State = {"embed.W_E": src.take("model.embed_tokens.weight", (cfg.d_vocab, d))}
    for layer in range(cfg.n_layers):
        h, p = f"model.layers.{layer}", f"blocks.{layer}"
        sd[f"{p}.ln1.w"] = src.take(f"{h}.input_layernorm.weight", (d,))
        sd[f"{p}.ln2.w"] = src.take(f"{h}.post_attention_layernorm.weight", (d,))
        sd.update(_take_attention(src, w, cfg, f"{h}.self_attn", f"{p}.attn", rope_gain))
        if cfg.layer_has_experts(layer):
            sd.update(_take_experts(src, w, cfg, f"{h}.mlp", f"{p}.mlp"))
        else:  # a dense layer (before the experts: d_mlp_dense wide)
            m = cfg.layer_d_mlp(layer) or 0
            sd[f"{p}.mlp.W_gate"] = w.take(f"{h}.mlp.gate_proj.weight", (m, d), _T)
            sd[f"{p}.mlp.W_in"] = w.take(f"{h}.mlp.up_proj.weight", (m, d), _T)
            sd[f"{p}.mlp.W_out"] = w.take(f"{h}.mlp.down_proj.weight", (d, m), _T)
    sd["ln_final.w"] = src.take("model.norm.weight", (d,))
    tied = ConfigReader(hf).flag("tie_word_embeddings", default=False)
    sd["unembed.W_U"] = take_unembedding(src, folder, sd["embed.W_E"], tied)
    mtp = ConfigReader(hf).integer("num_nextn_predict_layers", default=0, ge=0)  # multi-token prediction layers
    extra = tuple(f"model.layers.{layer}." for layer in range(cfg.n_layers, cfg.n_layers + mtp))
    src.left = {k for k in src.left if not k.startswith(extra)} if extra else src.left
    src.finish()
    return cfg, sd, dict(src.where), src.files


class _Linears:
    """The nn.Linear weights of a DeepSeek file: read as stored, or, where a weight_scale_inv sits beside a weight of a
    block-scaled FP8 file, dequantised (fp8.py) and then laid out."""

    def __init__(self, src: _Shards, block: tuple[int, int] | None):
        self.src, self.block = src, block

    def take(self, key: str, shape: tuple[int, int], layout: Callable[[Tensor], Tensor] = lambda t: t) -> Tensor:
        scale = key.removesuffix("weight") + "weight_scale_inv"
        if self.block is None or not self.src.has(scale):
            return self.src.take(key, shape, layout)
        q = self.src.take(key, shape, dtype=torch.float8_e4m3fn)
        scale_inv = self.src.take(scale, scale_grid(shape, self.block), dtype=torch.float32)
        return laid_out(layout(dequantize_fp8(q, scale_inv, self.block, torch.float32)), self.src.dtype)


def _take_attention(src: _Shards, w: _Linears, cfg: ModelConfig, h: str, p: str, rope_gain: float) -> State:
    d, H, dh, r_kv = cfg.d_model, cfg.n_heads, cfg.d_head, cfg.mla_kv_rank or 0
    d_nope, d_rope, d_v = cfg.mla_d_nope, cfg.rotary_dim or 0, cfg.mla_d_v
    d_qk = d_nope + d_rope
    sd: State = {}
    if cfg.mla_q_rank is not None:
        r_q = cfg.mla_q_rank
        sd[f"{p}.W_DQ"] = w.take(f"{h}.q_a_proj.weight", (r_q, d), _T)  # [d_model, q_rank]
        sd[f"{p}.q_latent_norm.w"] = src.take(f"{h}.q_a_layernorm.weight", (r_q,))
        up = f"{h}.q_b_proj.weight"
    else:
        r_q, up = d, f"{h}.q_proj.weight"
    sd[f"{p}.W_UQ"] = w.take(up, (H * d_qk, r_q), _heads(H, d_qk, 0, d_nope, r_q))  # [H, q_rank, d_nope]
    sd[f"{p}.W_QR"] = w.take(up, (H * d_qk, r_q), _heads(H, d_qk, d_nope, d_qk, r_q)) * rope_gain
    down = f"{h}.kv_a_proj_with_mqa.weight"
    sd[f"{p}.W_DKV"] = w.take(down, (r_kv + d_rope, d), lambda W: W[:r_kv].T)  # [d_model, kv_rank]
    sd[f"{p}.W_KR"] = w.take(down, (r_kv + d_rope, d), lambda W: W[r_kv:].T)  # [d_model, d_rope]
    sd[f"{p}.kv_latent_norm.w"] = src.take(f"{h}.kv_a_layernorm.weight", (r_kv,))
    kv_up = f"{h}.kv_b_proj.weight"
    rows = d_nope + d_v
    sd[f"{p}.W_UK"] = w.take(kv_up, (H * rows, r_kv), _heads(H, rows, 0, d_nope, r_kv))  # [H, kv_rank, d_nope]
    sd[f"{p}.W_UV"] = w.take(kv_up, (H * rows, r_kv), _heads(H, rows, d_nope, rows, r_kv))  # [H, kv_rank, d_v]
    W_O = torch.zeros(H, dh, d, dtype=src.dtype)
    W_O[:, :d_v] = w.take(f"{h}.o_proj.weight", (d, H * d_v), lambda W: W.T.reshape(H, d_v, d))
    sd[f"{p}.W_O"] = W_O  # [H, d_head, d_model], rows from d_v on zero
    return sd


def _take_experts(src: _Shards, w: _Linears, cfg: ModelConfig, h: str, p: str) -> State:
    E, d, m = cfg.num_experts or 0, cfg.d_model, cfg.d_mlp or 0
    sd: State = {f"{p}.W_router": src.take(f"{h}.gate.weight", (E, d), _T)}  # [d_model, n_experts]
    if cfg.moe_scoring == "sigmoid":
        sd[f"{p}.b_choice"] = src.take(f"{h}.gate.e_score_correction_bias", (E,))
    for name, stored, shape in (
        ("W_gate", "gate_proj", (m, d)),
        ("W_in", "up_proj", (m, d)),
        ("W_out", "down_proj", (d, m)),
    ):
        stacked = torch.empty(E, shape[1], shape[0], dtype=src.dtype)  # [E, d_in, d_out], x @ W form
        for e in range(E):  # one expert at a time, converted (or dequantised) and transposed as it is read
            stacked[e] = w.take(f"{h}.experts.{e}.{stored}.weight", shape, _T)
        sd[f"{p}.{name}"] = stacked
    if cfg.moe_shared_d_mlp is not None:
        s = cfg.moe_shared_d_mlp
        sd[f"{p}.W_shared_gate"] = w.take(f"{h}.shared_experts.gate_proj.weight", (s, d), _T)
        sd[f"{p}.W_shared_in"] = w.take(f"{h}.shared_experts.up_proj.weight", (s, d), _T)
        sd[f"{p}.W_shared_out"] = w.take(f"{h}.shared_experts.down_proj.weight", (d, s), _T)
    return sd
