"""Hugging Face GPT-2 and GPT-NeoX (Pythia) checkpoints, converted to TransformerLens names and shapes.

GPT-2 (`model_type: gpt2`): Conv1D layers store weights as [d_in, d_out], i.e. already `x @ W`:
    c_attn.weight [d_model, 3*d_model] = [W_Q | W_K | W_V], each column block head-major (n_heads, d_head);
    c_proj.weight [n_heads*d_head, d_model] -> W_O [n_heads, d_head, d_model]; LN eps `layer_norm_epsilon`;
    learned positions added to the residual stream ("standard"); gelu_new; W_U = W_E^T when tied.
GPT-NeoX (`model_type: gpt_neox`): nn.Linear stores [d_out, d_in], so weights are transposed:
    query_key_value.weight [3*d_model, d_model] is interleaved per head: rows = (n_heads, 3, d_head);
    rotary on the first int(d_head * rotary_pct) dims (rotate-half), parallel attention/MLP when
    `use_parallel_residual`; exact gelu; embed_out untied (W_U = embed_out^T).
The output is a TransformerLens state dict checked afterwards by statedict.build_model. Neither family has
an unembedding bias, so b_U is zero.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuits_core.errors import CheckpointError, InvalidInputError
from circuits_core.formats.statedict import folder_file, folder_listing, read_json_object, read_weight_files
from circuits_core.model.config import ModelConfig
from circuits_core.model.config_reader import ConfigReader

State = dict[str, Tensor]


def hf_weight_files(folder: Path) -> list[Path]:
    """The weight files of an HF folder: safetensors first, then pytorch_model.bin; sharded via the index."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if folder_file(folder, index_name).is_file():
            weight_map = read_json_object(folder, index_name).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(
                    f"{index_name}: not a shard index (weight_map must map tensor names to file names)"
                )
            return [folder_file(folder, shard) for shard in sorted(set(weight_map.values()))]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if folder_file(folder, name).is_file():
            return [folder_file(folder, name)]
    raise CheckpointError(f"{folder}: no model.safetensors or pytorch_model.bin (found: {folder_listing(folder)})")


class _Source:
    """A raw HF state dict: `take` removes a tensor after checking its shape; `left` lists what remains."""

    def __init__(self, state: State, origin: dict[str, str], prefix: str, ignore: tuple[str, ...]):
        self.state = {k: v for k, v in state.items() if not k.endswith(ignore)}
        self.origin, self.prefix = origin, prefix

    def take(self, key: str, shape: tuple[int, ...], optional: bool = False) -> Tensor | None:
        for full in (self.prefix + key, key):
            if full in self.state:
                value = self.state.pop(full)
                if tuple(value.shape) != shape:
                    raise CheckpointError(
                        f"{self.origin[full]}: key {full}: expected shape {list(shape)}, given {list(value.shape)}"
                    )
                return value
        if optional:
            return None
        files = ", ".join(sorted(set(self.origin.values())))
        raise CheckpointError(f"{files}: missing key {self.prefix + key} (expected shape {list(shape)})")

    def need(self, key: str, shape: tuple[int, ...]) -> Tensor:
        value = self.take(key, shape)
        assert value is not None
        return value

    def finish(self) -> None:
        if self.state:
            first = next(iter(self.state))
            raise CheckpointError(
                f"{self.origin[first]}: {len(self.state)} unexpected key(s) for this config: "
                f"{', '.join(list(self.state)[:8])}"
            )


def _config(path: Path, **fields: Any) -> ModelConfig:
    try:
        return ModelConfig(**fields)
    except InvalidInputError as exc:
        raise CheckpointError(f"{path.name}: {exc}") from exc


def _act_fn(r: ConfigReader, field: str, default: str) -> str:
    aliases = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "relu": "relu", "silu": "silu"}
    name = r.text(field, default=default)
    if name not in aliases:
        raise CheckpointError(
            f"{r.source}: field {field}: activation {name!r} is not supported; supported: {sorted(aliases)}"
        )
    return aliases[name]


def _bos(r: ConfigReader, d_vocab: int) -> int | None:
    """bos_token_id when it is a vocabulary id (some configs name one past a padded vocabulary: ignored)."""
    bos = r.integer("bos_token_id", default=None, ge=0)
    return bos if bos is not None and bos < d_vocab else None


def load_gpt2(
    folder: Path, hf: dict[str, Any], dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, State, dict[str, str], list[Path]]:
    """(config, state dict as stored -- load_checkpoint converts it to `dtype`, tensor -> file, files)."""
    path = folder / "config.json"
    r = ConfigReader(hf, path.name)
    if r.flag("scale_attn_by_inverse_layer_idx", default=False):
        raise CheckpointError(f"{path.name}: scale_attn_by_inverse_layer_idx=true is not supported")
    d, n_heads, n_layers = r.integer("n_embd", ge=1), r.integer("n_head", ge=1), r.integer("n_layer", ge=0)
    d_vocab = r.integer("vocab_size", ge=1)
    n_ctx = r.integer("n_positions", ge=1) if r.has("n_positions") else r.integer("n_ctx", ge=1)
    if d % n_heads:
        raise CheckpointError(f"{path.name}: n_embd={d} is not divisible by n_head={n_heads}")
    dh, d_mlp = d // n_heads, r.integer("n_inner", default=4 * d, ge=1)
    cfg = _config(
        path, n_layers=n_layers, d_model=d, n_heads=n_heads, d_head=dh, d_vocab=d_vocab, n_ctx=n_ctx,
        d_mlp=d_mlp, attn_only=False, normalization_type="LN", positional_embedding_type="standard",
        act_fn=_act_fn(r, "activation_function", "gelu_new"),
        eps=r.number("layer_norm_epsilon", default=1e-5, gt=0), use_bias=True,
        attn_scale=None if r.flag("scale_attn_weights", default=True) else 1.0, bos_token_id=_bos(r, d_vocab),
    )  # fmt: skip
    files = hf_weight_files(folder)
    raw, origin = read_weight_files(files)
    src = _Source(raw, origin, "transformer.", ignore=(".attn.bias", ".attn.masked_bias"))
    sd: State = {
        "embed.W_E": src.need("wte.weight", (d_vocab, d)),
        "pos_embed.W_pos": src.need("wpe.weight", (n_ctx, d)),
        "ln_final.w": src.need("ln_f.weight", (d,)),
        "ln_final.b": src.need("ln_f.bias", (d,)),
    }
    for layer in range(n_layers):
        h, p = f"h.{layer}", f"blocks.{layer}"
        sd[f"{p}.ln1.w"], sd[f"{p}.ln1.b"] = src.need(f"{h}.ln_1.weight", (d,)), src.need(f"{h}.ln_1.bias", (d,))
        sd[f"{p}.ln2.w"], sd[f"{p}.ln2.b"] = src.need(f"{h}.ln_2.weight", (d,)), src.need(f"{h}.ln_2.bias", (d,))
        qkv_w = src.need(f"{h}.attn.c_attn.weight", (d, 3 * d))  # [d_model, 3 * n_heads * d_head]
        qkv_b = src.need(f"{h}.attn.c_attn.bias", (3 * d,))
        for i, x in enumerate("QKV"):
            W = qkv_w[:, i * d : (i + 1) * d].reshape(d, n_heads, dh)  # [d_model, n_heads, d_head]
            sd[f"{p}.attn.W_{x}"] = W.permute(1, 0, 2)  # [n_heads, d_model, d_head]
            sd[f"{p}.attn.b_{x}"] = qkv_b[i * d : (i + 1) * d].reshape(n_heads, dh)
        sd[f"{p}.attn.W_O"] = src.need(f"{h}.attn.c_proj.weight", (d, d)).reshape(n_heads, dh, d)
        sd[f"{p}.attn.b_O"] = src.need(f"{h}.attn.c_proj.bias", (d,))
        sd[f"{p}.mlp.W_in"] = src.need(f"{h}.mlp.c_fc.weight", (d, d_mlp))  # [d_model, d_mlp]
        sd[f"{p}.mlp.b_in"] = src.need(f"{h}.mlp.c_fc.bias", (d_mlp,))
        sd[f"{p}.mlp.W_out"] = src.need(f"{h}.mlp.c_proj.weight", (d_mlp, d))  # [d_mlp, d_model]
        sd[f"{p}.mlp.b_out"] = src.need(f"{h}.mlp.c_proj.bias", (d,))
    lm_head = src.take("lm_head.weight", (d_vocab, d), optional=True)
    if (
        lm_head is not None
        and r.flag("tie_word_embeddings", default=True)
        and not torch.equal(lm_head, sd["embed.W_E"])
    ):
        raise CheckpointError(
            f"{origin['lm_head.weight']}: lm_head.weight differs from wte.weight but the config ties them"
        )
    sd["unembed.W_U"] = (lm_head if lm_head is not None else sd["embed.W_E"]).T  # [d_model, d_vocab]
    sd["unembed.b_U"] = torch.zeros(d_vocab, dtype=sd["embed.W_E"].dtype)
    src.finish()
    return cfg, sd, origin, files


def load_gpt_neox(
    folder: Path, hf: dict[str, Any], dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, State, dict[str, str], list[Path]]:
    """(config, state dict as stored -- load_checkpoint converts it to `dtype`, tensor -> file, files)."""
    path = folder / "config.json"
    r = ConfigReader(hf, path.name)
    rope = r.section("rope_parameters" if r.has("rope_parameters") else "rope_scaling")
    rope_type = rope.text("rope_type", default=None) or rope.text("type", default="default")
    if rope_type != "default":
        raise CheckpointError(
            f"{path.name}: field {rope.prefix}rope_type {rope_type!r} is not supported (default only)"
        )
    d, n_heads = r.integer("hidden_size", ge=1), r.integer("num_attention_heads", ge=1)
    n_layers, d_vocab = r.integer("num_hidden_layers", ge=0), r.integer("vocab_size", ge=1)
    n_ctx, d_mlp = r.integer("max_position_embeddings", ge=1), r.integer("intermediate_size", ge=1)
    if d % n_heads:
        raise CheckpointError(f"{path.name}: hidden_size={d} is not divisible by num_attention_heads={n_heads}")
    dh = d // n_heads
    rotary_pct = r.number("rotary_pct", default=None, gt=0, le=1)
    if rotary_pct is None:
        rotary_pct = rope.number("partial_rotary_factor", default=0.25, gt=0, le=1)
    rotary_base = r.number("rotary_emb_base", default=None, gt=0)
    if rotary_base is None:
        rotary_base = rope.number("rope_theta", default=None, gt=0) or r.number("rope_theta", default=10000.0, gt=0)
    cfg = _config(
        path, n_layers=n_layers, d_model=d, n_heads=n_heads, d_head=dh, d_vocab=d_vocab, n_ctx=n_ctx,
        d_mlp=d_mlp, attn_only=False, normalization_type="LN", positional_embedding_type="rotary",
        act_fn=_act_fn(r, "hidden_act", "gelu"), eps=r.number("layer_norm_eps", default=1e-5, gt=0),
        use_bias=True, parallel_attn_mlp=r.flag("use_parallel_residual", default=True),
        rotary_dim=int(dh * rotary_pct), rotary_base=rotary_base, bos_token_id=_bos(r, d_vocab),
    )  # fmt: skip
    files = hf_weight_files(folder)
    raw, origin = read_weight_files(files)
    ignore = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")
    src = _Source(raw, origin, "gpt_neox.", ignore=ignore)
    W_E = src.need("embed_in.weight", (d_vocab, d))
    sd: State = {"embed.W_E": W_E}
    for layer in range(n_layers):
        h, p = f"layers.{layer}", f"blocks.{layer}"
        for ln, name in (("ln1", "input_layernorm"), ("ln2", "post_attention_layernorm")):
            sd[f"{p}.{ln}.w"] = src.need(f"{h}.{name}.weight", (d,))
            sd[f"{p}.{ln}.b"] = src.need(f"{h}.{name}.bias", (d,))
        qkv_w = src.need(f"{h}.attention.query_key_value.weight", (3 * d, d)).reshape(n_heads, 3, dh, d)
        qkv_b = src.take(f"{h}.attention.query_key_value.bias", (3 * d,), optional=True)
        qkv_b = (qkv_b if qkv_b is not None else torch.zeros(3 * d, dtype=W_E.dtype)).reshape(n_heads, 3, dh)
        for i, x in enumerate("QKV"):
            sd[f"{p}.attn.W_{x}"] = qkv_w[:, i].transpose(1, 2)  # [n_heads, d_model, d_head]
            sd[f"{p}.attn.b_{x}"] = qkv_b[:, i]  # [n_heads, d_head]
        dense = src.need(f"{h}.attention.dense.weight", (d, d))  # [d_model(out), n_heads * d_head(in)]
        sd[f"{p}.attn.W_O"] = dense.T.reshape(n_heads, dh, d)
        b_O = src.take(f"{h}.attention.dense.bias", (d,), optional=True)
        sd[f"{p}.attn.b_O"] = b_O if b_O is not None else torch.zeros(d, dtype=W_E.dtype)
        sd[f"{p}.mlp.W_in"] = src.need(f"{h}.mlp.dense_h_to_4h.weight", (d_mlp, d)).T  # [d_model, d_mlp]
        sd[f"{p}.mlp.b_in"] = src.need(f"{h}.mlp.dense_h_to_4h.bias", (d_mlp,))
        sd[f"{p}.mlp.W_out"] = src.need(f"{h}.mlp.dense_4h_to_h.weight", (d, d_mlp)).T  # [d_mlp, d_model]
        sd[f"{p}.mlp.b_out"] = src.need(f"{h}.mlp.dense_4h_to_h.bias", (d,))
    sd["ln_final.w"] = src.need("final_layer_norm.weight", (d,))
    sd["ln_final.b"] = src.need("final_layer_norm.bias", (d,))
    embed_out = src.take("embed_out.weight", (d_vocab, d), optional=r.flag("tie_word_embeddings", default=False))
    sd["unembed.W_U"] = (embed_out if embed_out is not None else W_E).T  # [d_model, d_vocab]
    sd["unembed.b_U"] = torch.zeros(d_vocab, dtype=W_E.dtype)
    src.finish()
    return cfg, sd, origin, files
