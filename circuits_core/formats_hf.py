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

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuits_core.config import ModelConfig
from circuits_core.errors import CheckpointError, InvalidInputError
from circuits_core.statedict import folder_listing, read_weight_files

State = dict[str, Tensor]


def hf_weight_files(folder: Path) -> list[Path]:
    """The weight files of an HF folder: safetensors first, then pytorch_model.bin; sharded via the index."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = folder / index_name
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as exc:
                raise CheckpointError(f"{index}: not a readable shard index ({exc})") from exc
            return [folder / shard for shard in shards]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return [folder / name]
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
        raise CheckpointError(f"{path}: {exc}") from exc


def _act_fn(name: Any, path: Path) -> str:
    aliases = {"gelu": "gelu", "gelu_new": "gelu_new", "gelu_pytorch_tanh": "gelu_new", "relu": "relu"}
    if name not in aliases:
        raise CheckpointError(f"{path}: activation {name!r} is not supported; supported: {sorted(aliases)}")
    return aliases[name]


def _bos(hf: dict[str, Any], d_vocab: int) -> int | None:
    bos = hf.get("bos_token_id")
    return bos if isinstance(bos, int) and 0 <= bos < d_vocab else None


def load_gpt2(folder: Path, hf: dict[str, Any]) -> tuple[ModelConfig, State, dict[str, str], list[Path]]:
    path = folder / "config.json"
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise CheckpointError(f"{path}: scale_attn_by_inverse_layer_idx=true is not supported")
    try:
        d, n_heads, n_layers = int(hf["n_embd"]), int(hf["n_head"]), int(hf["n_layer"])
        d_vocab, n_ctx = int(hf["vocab_size"]), int(hf.get("n_positions") or hf["n_ctx"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: GPT-2 config lacks a field: {exc}") from exc
    if d % n_heads:
        raise CheckpointError(f"{path}: n_embd={d} is not divisible by n_head={n_heads}")
    dh, d_mlp = d // n_heads, int(hf.get("n_inner") or 4 * d)
    cfg = _config(
        path, n_layers=n_layers, d_model=d, n_heads=n_heads, d_head=dh, d_vocab=d_vocab, n_ctx=n_ctx,
        d_mlp=d_mlp, attn_only=False, normalization_type="LN", positional_embedding_type="standard",
        act_fn=_act_fn(hf.get("activation_function", "gelu_new"), path),
        eps=float(hf.get("layer_norm_epsilon", 1e-5)), use_bias=True,
        attn_scale=None if hf.get("scale_attn_weights", True) else 1.0, bos_token_id=_bos(hf, d_vocab),
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
    if lm_head is not None and hf.get("tie_word_embeddings", True) and not torch.equal(lm_head, sd["embed.W_E"]):
        raise CheckpointError(
            f"{origin['lm_head.weight']}: lm_head.weight differs from wte.weight but the config ties them"
        )
    sd["unembed.W_U"] = (lm_head if lm_head is not None else sd["embed.W_E"]).T  # [d_model, d_vocab]
    sd["unembed.b_U"] = torch.zeros(d_vocab, dtype=sd["embed.W_E"].dtype)
    src.finish()
    return cfg, sd, origin, files


def load_gpt_neox(folder: Path, hf: dict[str, Any]) -> tuple[ModelConfig, State, dict[str, str], list[Path]]:
    path = folder / "config.json"
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise CheckpointError(
            f"{path}: rope_type {rope.get('rope_type', rope.get('type'))!r} is not supported (default only)"
        )
    try:
        d, n_heads, n_layers = int(hf["hidden_size"]), int(hf["num_attention_heads"]), int(hf["num_hidden_layers"])
        d_vocab, n_ctx, d_mlp = int(hf["vocab_size"]), int(hf["max_position_embeddings"]), int(hf["intermediate_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: GPT-NeoX config lacks a field: {exc}") from exc
    if d % n_heads:
        raise CheckpointError(f"{path}: hidden_size={d} is not divisible by num_attention_heads={n_heads}")
    dh = d // n_heads
    rotary_pct = float(hf.get("rotary_pct", rope.get("partial_rotary_factor", 0.25)))
    rotary_base = float(hf.get("rotary_emb_base", rope.get("rope_theta", hf.get("rope_theta", 10000.0))))
    cfg = _config(
        path, n_layers=n_layers, d_model=d, n_heads=n_heads, d_head=dh, d_vocab=d_vocab, n_ctx=n_ctx,
        d_mlp=d_mlp, attn_only=False, normalization_type="LN", positional_embedding_type="rotary",
        act_fn=_act_fn(hf.get("hidden_act", "gelu"), path), eps=float(hf.get("layer_norm_eps", 1e-5)),
        use_bias=True, parallel_attn_mlp=bool(hf.get("use_parallel_residual", True)),
        rotary_dim=int(dh * rotary_pct), rotary_base=rotary_base, bos_token_id=_bos(hf, d_vocab),
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
    embed_out = src.take("embed_out.weight", (d_vocab, d), optional=bool(hf.get("tie_word_embeddings", False)))
    sd["unembed.W_U"] = (embed_out if embed_out is not None else W_E).T  # [d_model, d_vocab]
    sd["unembed.b_U"] = torch.zeros(d_vocab, dtype=W_E.dtype)
    src.finish()
    return cfg, sd, origin, files
