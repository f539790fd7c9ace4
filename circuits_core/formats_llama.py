"""Hugging Face Llama, Mistral and Qwen2 checkpoints, converted to TransformerLens names and shapes.

Config (`model_type` llama, mistral or qwen2; transformers' field names):
    hidden_size, num_attention_heads, num_key_value_heads (grouped-query attention), head_dim (default
    hidden_size / heads), intermediate_size, num_hidden_layers, vocab_size, max_position_embeddings,
    rms_norm_eps, hidden_act (silu: SwiGLU), tie_word_embeddings, bos_token_id; rope: `rope_parameters`
    (transformers >= 5) or `rope_scaling` + `rope_theta`, types default, linear and llama3 (any other type is
    refused, naming it); biases: Llama `attention_bias` (q, k, v, o), Qwen2 always q, k, v (o none), Mistral
    none. A sliding window (Mistral `sliding_window`, Qwen2 `use_sliding_window`) never masks a sequence no
    longer than the window, so the context is capped at the window and the model stays exact.
Weights (nn.Linear stores [d_out, d_in], so each is transposed into `x @ W` form):
    model.embed_tokens.weight [V, d]                     -> embed.W_E
    model.layers.{l}.input_layernorm.weight [d]          -> blocks.{l}.ln1.w (RMS)
    self_attn.q_proj.weight [H dh, d] rows (head, e)     -> attn.W_Q [H, d, dh]   (q_proj.bias -> b_Q [H, dh])
    self_attn.k_proj / v_proj [G dh, d]                  -> attn._W_K / _W_V [G, d, dh] (G = key/value heads;
                                                            W_K / W_V when G = H)
    self_attn.o_proj.weight [d, H dh] columns (head, e)  -> attn.W_O [H, dh, d]
    post_attention_layernorm.weight                      -> ln2.w
    mlp.gate_proj / up_proj [d_mlp, d]                   -> mlp.W_gate / W_in [d, d_mlp]; down_proj -> W_out
    model.norm.weight                                    -> ln_final.w
    lm_head.weight [V, d] (absent when tied)             -> unembed.W_U [d, V] (W_E^T when tied)
Hugging Face rotates halves (rotate-half layout, rotary_adjacent_pairs False), so Q and K rows keep their
order. Reading: safetensors only (the index `model.safetensors.index.json` names the shards; every file name
is resolved inside the folder); files are memory-mapped and each tensor is converted to the compute dtype as
it is read and laid out, so the peak is about one compute-dtype copy of the model plus one tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from circuits_core.config import ConfigReader, ModelConfig
from circuits_core.errors import CheckpointError
from circuits_core.formats_hf import _act_fn, _bos, _config
from circuits_core.model import attn_param
from circuits_core.statedict import folder_file, folder_listing, read_json_object

State = dict[str, Tensor]
LLAMA_MODEL_TYPES = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "llama3")
INDEX = "model.safetensors.index.json"
_IGNORED = (".rotary_emb.inv_freq",)


class _Shards:
    """The tensors of a safetensors checkpoint, read one at a time (memory-mapped) and converted to `dtype`."""

    def __init__(self, folder: Path, dtype: torch.dtype):
        self.dtype = dtype
        self.where: dict[str, str] = {}  # tensor name -> shard file name
        if folder_file(folder, INDEX).is_file():
            weight_map = read_json_object(folder, INDEX).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{INDEX}: not a shard index (weight_map must map tensor names to file names)")
            names = sorted(set(weight_map.values()))
        elif folder_file(folder, "model.safetensors").is_file():
            names = ["model.safetensors"]
        else:
            raise CheckpointError(
                f"no model.safetensors or {INDEX} (found: {folder_listing(folder)}); the Llama-family loader "
                "reads safetensors only"
            )
        self.files = [folder_file(folder, name) for name in names]
        self.handles: dict[str, Any] = {}
        for name, path in zip(names, self.files, strict=True):
            if not path.is_file():
                raise CheckpointError(f"{name}: shard named by {INDEX} not found (found: {folder_listing(folder)})")
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError) as exc:
                raise CheckpointError(f"{name}: not a readable safetensors file ({exc})") from exc
            self.handles[name] = handle
            for key in handle.keys():
                if key in self.where:
                    raise CheckpointError(f"{name}: tensor {key!r} is also in {self.where[key]}")
                self.where[key] = name
        self.left = {k for k in self.where if not k.endswith(_IGNORED)}

    def has(self, key: str) -> bool:
        return key in self.where

    def take(self, key: str, shape: tuple[int, ...]) -> Tensor:
        """The tensor `key`, shape-checked before it is read, in the compute dtype."""
        if key not in self.where:
            raise CheckpointError(
                f"{', '.join(sorted(set(self.where.values())))}: missing tensor {key} (expected shape {list(shape)})"
            )
        handle = self.handles[self.where[key]]
        given = tuple(handle.get_slice(key).get_shape())
        if given != shape:
            raise CheckpointError(f"{self.where[key]}: tensor {key}: expected shape {list(shape)}, given {list(given)}")
        tensor = handle.get_tensor(key)
        if not tensor.is_floating_point():
            raise CheckpointError(f"{self.where[key]}: tensor {key}: expected floating point, given {tensor.dtype}")
        self.left.discard(key)
        return tensor.to(self.dtype)

    def finish(self) -> None:
        if self.left:
            extra = sorted(self.left)
            raise CheckpointError(
                f"{self.where[extra[0]]}: {len(extra)} tensor(s) this config has no place for: "
                f"{', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''} (does config.json match the weights?)"
            )


def _rope(r: ConfigReader, name: str) -> dict[str, Any]:
    """Rope fields for ModelConfig from `rope_parameters` (transformers >= 5) or `rope_scaling` + `rope_theta`."""
    rope = r.section("rope_parameters") if r.has("rope_parameters") else r.section("rope_scaling")
    kind = rope.text("rope_type", default=None) or rope.text("type", default="default")
    if kind not in ROPE_TYPES:
        raise CheckpointError(f"{name}: rope scaling type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    base = rope.number("rope_theta", default=None, gt=0) or r.number("rope_theta", default=10000.0, gt=0)
    fields: dict[str, Any] = {"rotary_base": base, "rope_type": kind}
    if kind in ("linear", "llama3"):
        fields["rope_factor"] = rope.number("factor", gt=0)
    if kind == "llama3":
        fields["rope_low_freq_factor"] = rope.number("low_freq_factor", gt=0)
        fields["rope_high_freq_factor"] = rope.number("high_freq_factor", gt=0)
        fields["rope_original_max_position_embeddings"] = rope.integer("original_max_position_embeddings", ge=1)
    factor = rope.number("partial_rotary_factor", default=None, gt=0) or r.number("partial_rotary_factor", default=1.0, gt=0)
    if factor != 1.0:
        raise CheckpointError(f"{name}: partial_rotary_factor={factor} is not supported for Llama-family files")
    return fields


def _window(r: ConfigReader, model_type: str) -> int | None:
    """The sliding-window length when one applies (Mistral: `sliding_window`; Qwen2: `use_sliding_window`)."""
    if model_type == "qwen2" and not r.flag("use_sliding_window", default=False):
        return None
    if model_type == "llama":
        return None
    return r.integer("sliding_window", default=None, ge=1)


def llama_config(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig of a Llama / Mistral / Qwen2 config.json (refusing what the model does not implement)."""
    path = Path("config.json")
    r = ConfigReader(hf, path.name)
    model_type = r.text("model_type")
    if model_type not in LLAMA_MODEL_TYPES:
        raise CheckpointError(f"{path.name}: model_type {model_type!r} is not one of {', '.join(LLAMA_MODEL_TYPES)}")
    d, n_heads = r.integer("hidden_size", ge=1), r.integer("num_attention_heads", ge=1)
    n_kv = r.integer("num_key_value_heads", default=n_heads, ge=1)
    if n_heads % n_kv:
        raise CheckpointError(f"{path.name}: num_key_value_heads={n_kv} does not divide num_attention_heads={n_heads}")
    dh = r.integer("head_dim", default=None, ge=1)
    if dh is None:
        if d % n_heads:
            raise CheckpointError(f"{path.name}: hidden_size={d} is not divisible by num_attention_heads={n_heads}")
        dh = d // n_heads
    if r.flag("mlp_bias", default=False):
        raise CheckpointError(f"{path.name}: mlp_bias=true is not supported (the gated MLP has one bias, after the gate)")
    attention_bias = {"llama": r.flag("attention_bias", default=False), "mistral": False, "qwen2": True}[model_type]
    d_vocab, n_ctx = r.integer("vocab_size", ge=1), r.integer("max_position_embeddings", ge=1)
    window = _window(r, model_type)
    return _config(
        path, n_layers=r.integer("num_hidden_layers", ge=0), d_model=d, n_heads=n_heads, d_head=dh,
        d_vocab=d_vocab, n_ctx=min(n_ctx, window) if window else n_ctx, d_mlp=r.integer("intermediate_size", ge=1),
        attn_only=False, normalization_type="RMS", positional_embedding_type="rotary", gated_mlp=True,
        act_fn=_act_fn(r, "hidden_act", "silu"), eps=r.number("rms_norm_eps", default=1e-6, gt=0),
        use_bias=attention_bias, n_key_value_heads=n_kv if n_kv != n_heads else None, rotary_dim=dh,
        bos_token_id=_bos(r, d_vocab), **_rope(r, path.name),
    )  # fmt: skip


def load_llama(folder: Path, hf: dict[str, Any], dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, State, dict[str, str], list[Path]]:
    """(config, TransformerLens state dict in `dtype`, tensor -> shard file, weight files)."""
    cfg = llama_config(hf)
    src = _Shards(folder, dtype)
    d, H, G, dh, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.d_vocab
    d_mlp = cfg.d_mlp or 0
    qwen2 = hf.get("model_type") == "qwen2"
    sd: State = {"embed.W_E": src.take("model.embed_tokens.weight", (V, d))}
    for layer in range(cfg.n_layers):
        h, p = f"model.layers.{layer}", f"blocks.{layer}"
        sd[f"{p}.ln1.w"] = src.take(f"{h}.input_layernorm.weight", (d,))
        sd[f"{p}.ln2.w"] = src.take(f"{h}.post_attention_layernorm.weight", (d,))
        for x, proj, heads in (("Q", "q_proj", H), ("K", "k_proj", G), ("V", "v_proj", G)):
            W = src.take(f"{h}.self_attn.{proj}.weight", (heads * dh, d))  # [heads * d_head, d_model]
            sd[f"{p}.attn.{attn_param(cfg, 'W_' + x)}"] = W.view(heads, dh, d).transpose(1, 2).contiguous()
            if cfg.use_bias:
                b = src.take(f"{h}.self_attn.{proj}.bias", (heads * dh,))
                sd[f"{p}.attn.{attn_param(cfg, 'b_' + x)}"] = b.view(heads, dh)
        W_O = src.take(f"{h}.self_attn.o_proj.weight", (d, H * dh))  # [d_model, n_heads * d_head]
        sd[f"{p}.attn.W_O"] = W_O.T.reshape(H, dh, d).contiguous()
        if cfg.use_bias:
            has_o_bias = not qwen2
            sd[f"{p}.attn.b_O"] = src.take(f"{h}.self_attn.o_proj.bias", (d,)) if has_o_bias else torch.zeros(d, dtype=dtype)
            sd[f"{p}.mlp.b_in"] = torch.zeros(d_mlp, dtype=dtype)
            sd[f"{p}.mlp.b_out"] = torch.zeros(d, dtype=dtype)
        sd[f"{p}.mlp.W_gate"] = src.take(f"{h}.mlp.gate_proj.weight", (d_mlp, d)).T.contiguous()  # [d_model, d_mlp]
        sd[f"{p}.mlp.W_in"] = src.take(f"{h}.mlp.up_proj.weight", (d_mlp, d)).T.contiguous()
        sd[f"{p}.mlp.W_out"] = src.take(f"{h}.mlp.down_proj.weight", (d, d_mlp)).T.contiguous()  # [d_mlp, d_model]
    sd["ln_final.w"] = src.take("model.norm.weight", (d,))
    tied = ConfigReader(hf).flag("tie_word_embeddings", default=False)
    if src.has("lm_head.weight"):
        lm_head = src.take("lm_head.weight", (V, d))
        if tied and not torch.equal(lm_head, sd["embed.W_E"]):
            raise CheckpointError(f"{src.where['lm_head.weight']}: lm_head.weight differs from embed_tokens.weight "
                                  "but the config ties them (tie_word_embeddings)")
        sd["unembed.W_U"] = lm_head.T.contiguous()  # [d_model, d_vocab]
    elif tied:
        sd["unembed.W_U"] = sd["embed.W_E"].T.contiguous()
    else:
        raise CheckpointError(f"missing tensor lm_head.weight (tie_word_embeddings is false); found: {folder_listing(folder)}")
    if cfg.use_bias:
        sd["unembed.b_U"] = torch.zeros(V, dtype=dtype)
    src.finish()
    return cfg, sd, dict(src.where), src.files
