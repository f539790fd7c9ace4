"""GGUF checkpoints (llama.cpp's single-file format): Llama, Qwen2, Qwen3, Gemma 3 and Phi-3, the mixture-of-experts
Mixtral, Qwen3-MoE and OLMoE (their experts: gguf_experts.py), gpt-oss (gguf_gpt_oss.py), BLOOM and MPT
(gguf_alibi.py) and DeepSeek-V2/V3 (gguf_deepseek.py).

The file carries the architecture and hyper-parameters as metadata (`{arch}.block_count`, ...), the tokenizer
(`tokenizer.ggml.*`, gguf_tokenizer.py) and the tensors, most of them quantised (gguf_quants.py). The header is read
lazily (gguf_header.py): only the keys read here are decoded.

Layouts (ggml stores a linear layer like nn.Linear, [d_out, d_in] rows; TransformerLens uses x @ W):
    token_embd.weight  [d_vocab, d_model]            -> embed.W_E (Gemma: times sqrt(d_model), as Gemma embeds)
    blk.l.attn_q.weight [n_heads * d_head, d_model]  -> blocks.l.attn.W_Q  [n_heads, d_model, d_head]
    blk.l.attn_k/v      [n_kv * d_head, d_model]     -> blocks.l.attn._W_K/_W_V [n_kv, d_model, d_head]
    blk.l.attn_output   [d_model, n_heads * d_head]  -> blocks.l.attn.W_O  [n_heads, d_head, d_model]
    blk.l.attn_q_norm/k_norm [d_head]                -> blocks.l.attn.q_norm.w / k_norm.w (QK-norm gains; OLMoE's
                                                        span the layer's heads: [n_heads * d_head], [n_kv * d_head])
    blk.l.ffn_gate/up   [d_mlp, d_model]             -> blocks.l.mlp.W_gate / W_in [d_model, d_mlp]
    blk.l.ffn_down      [d_model, d_mlp]             -> blocks.l.mlp.W_out [d_mlp, d_model]
    blk.l.attn_norm, ffn_norm, output_norm           -> ln1.w, ln2.w, ln_final.w (RMSNorm gains)
    blk.l.post_attention_norm, post_ffw_norm         -> ln1_post.w, ln2_post.w (Gemma's sandwich norms)
    output.weight       [d_vocab, d_model]           -> unembed.W_U = output.T (absent: tied, token_embd.T)

Per architecture (ARCHITECTURES):
- Rotary layout, the classic trap: llama.cpp's converter permutes the Q and K rows of "llama" models so that
  ADJACENT dims (2i, 2i+1) form the rotary pairs (Hugging Face files pair i with i + d_head/2). Reading a GGUF
  with the rotate-half layout still runs and gives plausible but wrong numbers (SmolLM2: 12.9 nats instead of 3.0
  on the repeated half of a random sequence), so the config says `rotary_adjacent_pairs=True`. "qwen2", "qwen3"
  and "gemma3" rows are not permuted (llama.cpp runs them with its NEOX rope).
- "qwen2" adds q/k/v biases; "qwen3" per-head QK-norm.
- "phi3": Phi-3's fused projections, split on load: attn_qkv [(n_heads + 2 n_kv) d_head, d_model] (q's rows, then
  k's, then v's) and ffn_up [2 d_mlp, d_model] (the gate's rows, then up's); rows not permuted (NEOX rope); a
  `phi3.attention.sliding_window` masks every layer. The 128k models' longrope (rope_factors_long/short tensors)
  is refused as unexpected tensors.
- Mixtures of experts: "llama" files with {arch}.expert_count (Mixtral: Llama's permuted Q/K rows), "qwen3moe"
  (Qwen3's per-head QK-norm) and "olmoe" (a QK-norm over all of a layer's heads, rows not permuted: llama.cpp runs
  OLMoE with its NEOX rope). The routing normalisation is the architecture's (`norm_topk`, gguf_experts.py).
- "gemma3": per-head QK-norm, sandwich norms, GeGLU (tanh GELU), the embedding times sqrt(d_model), tied
  embeddings, a sliding window on local layers. Gemma applies every norm gain as (1 + w); llama.cpp's converter
  stores 1 + w in the file (transformers subtracts 1 on reading and adds it back in the model), so the gains are
  taken as stored, never shifted again.
- Values a gemma3 file does not carry come from GEMMA3_DEFAULTS (what transformers and llama.cpp assume), each
  with its source; `GGUFModel.defaulted` lists them and the model page shows them.
Any other architecture is refused by name.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from circuits_core.errors import CheckpointError, InvalidInputError
from circuits_core.formats.gguf_alibi import BLOOM, MPT, alibi_config, alibi_state
from circuits_core.formats.gguf_deepseek import DEEPSEEK2, deepseek_config, deepseek_state
from circuits_core.formats.gguf_experts import expert_fields, take_experts
from circuits_core.formats.gguf_gpt_oss import gpt_oss_fields, take_gpt_oss_extras
from circuits_core.formats.gguf_header import GGUFHeader
from circuits_core.formats.gguf_tensors import Metadata, Tensors
from circuits_core.formats.gguf_tokenizer import gguf_tokenizer
from circuits_core.formats.llama import laid_out, one_thread
from circuits_core.formats.tokenizer import Tokenizer
from circuits_core.model.config import ModelConfig, QKNormType
from circuits_core.schedule import split_loop

State = dict[str, Tensor]
F32 = torch.float32
GGUF_SUFFIX = ".gguf"
TOKENIZER_BESIDE = "tokenizer.json"  # read instead of a file's tokenizer this code does not build


@dataclass(frozen=True)
class Architecture:
    adjacent_pairs: bool  # Q/K rows permuted by llama.cpp's converter (adjacent rotary pairs)
    qk_norm: QKNormType = None  # attn_q_norm / attn_k_norm per head ("head") or over a layer's heads ("layer")
    gemma: bool = False  # sandwich norms, GeGLU, embedding x sqrt(d_model), gains stored as 1 + w
    norm_topk: bool | None = None  # experts' routing: top-k renormalised or not (None: no experts), gguf_experts.py
    gpt_oss: bool = False  # sinks, biases, alternating windows, YaRN, clamped SwiGLU experts (gguf_gpt_oss.py)
    fused: bool = False  # Phi-3: attn_qkv rows q, k, v; ffn_up rows gate, then up; a window on every layer


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(adjacent_pairs=True, norm_topk=True),
    "qwen2": Architecture(adjacent_pairs=False),
    "qwen3": Architecture(adjacent_pairs=False, qk_norm="head"),
    "gemma3": Architecture(adjacent_pairs=False, qk_norm="head", gemma=True),
    "qwen3moe": Architecture(adjacent_pairs=False, qk_norm="head", norm_topk=True),
    "olmoe": Architecture(adjacent_pairs=False, qk_norm="layer", norm_topk=False),
    "gpt-oss": Architecture(adjacent_pairs=False, norm_topk=True, gpt_oss=True),
    "phi3": Architecture(adjacent_pairs=False, fused=True),
}
# Architectures with a reader of their own: (config(meta, d_vocab, bos) -> (cfg, defaulted), state(cfg, tensors))
OWN_LAYOUTS: dict[str, tuple[Callable[..., tuple[ModelConfig, list[Any]]], Callable[[ModelConfig, Tensors], State]]] = {
    BLOOM: (alibi_config, alibi_state), MPT: (alibi_config, alibi_state), DEEPSEEK2: (deepseek_config, deepseek_state),
}  # fmt: skip
MOE_ONLY = ("qwen3moe", "olmoe", "gpt-oss")  # architectures whose files always have experts
# Newer GGUF architectures llama.cpp writes that qkov does not run, with what they would need.
REFUSED = {
    "gemma3n": "per-layer embeddings, AltUp and laurel blocks", "gemma4": "per-layer-type head dims",
    "qwen35": "linear-attention (Gated DeltaNet) layers",
    "qwen3next": "linear-attention layers and mixture-of-experts MLPs",
}  # fmt: skip


@dataclass(frozen=True)
class Defaulted:
    """A config value the file does not carry, the value used and where that value comes from."""

    field: str
    value: Any
    source: str


GEMMA3_LOCAL_ROPE_BASE = 10_000.0
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_SOURCES = {
    "rotary_base_local": "transformers Gemma3TextConfig(rope_local_base_freq=10000.0); llama.cpp gemma3 "
    "(freq_base_swa = 10000.0)",
    "attn_types": "every 6th layer global, the others local: transformers Gemma3TextConfig(sliding_window_pattern=6); "
    "llama.cpp gemma3 (set_swa_pattern(6))",
    "attn_scale": "sqrt(query_pre_attn_scalar), query_pre_attn_scalar = key_length: llama.cpp gemma3 scales by "
    "1/sqrt(key_length) for every size but 27B (62 layers: d_model / n_heads); transformers' Gemma3TextConfig "
    "default is 256",
}


@dataclass
class GGUFModel:
    """What a GGUF file holds for qkov."""

    cfg: ModelConfig
    state: State
    origin: dict[str, str]
    tokenizer: Tokenizer | None
    defaulted: list[Defaulted] = field(default_factory=list)


def gguf_file(folder: Path) -> str | None:
    """The name of the one `.gguf` file in a model folder, None when there is none; several are refused (which
    one would the model be?). Files beside it (a summary, qkov.json) do not count."""
    found = sorted(p.name for p in folder.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(found) > 1:
        raise CheckpointError(f"several .gguf files ({', '.join(found)}); a model folder holds one model")
    return found[0] if found else None


def _architecture(meta: Metadata) -> tuple[str, Architecture]:
    arch = meta.get("general.architecture")
    if arch in REFUSED:
        raise CheckpointError(f"{meta.name}: architecture {arch!r} is not supported yet ({REFUSED[arch]})")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{meta.name}: architecture {arch!r} is not supported; GGUF architectures read here: "
            f"{', '.join([*ARCHITECTURES, *OWN_LAYOUTS])}"
        )
    if arch in MOE_ONLY and not meta.get(f"{arch}.expert_count", 0):
        raise CheckpointError(f"{meta.name}: a {arch} file needs {arch}.expert_count (its MLPs are experts)")
    return arch, ARCHITECTURES[arch]


def _rope_scaling(meta: Metadata, arch: str, gemma: bool) -> dict[str, Any]:
    """rope_type and rope_factor: none, or linear on Gemma 3's global layers (its larger sizes)."""
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "none":
        return {}
    if scaling == "linear" and gemma:
        return {"rope_type": "linear", "rope_factor": meta.float(f"{arch}.rope.scaling.factor")}
    raise CheckpointError(
        f"{meta.name}: rope scaling type {scaling!r} is not supported for {arch} GGUF files "
        f"({'none or linear' if gemma else 'none only'})"
    )


def _gemma_fields(
    meta: Metadata, arch: str, n_layers: int, d_head: int, d_model: int, n_heads: int
) -> tuple[dict[str, Any], list[Defaulted]]:
    """Gemma 3's window, layer kinds, local rope base and score scale: (fields, values defaulted)."""
    defaulted: list[Defaulted] = []

    def read_or_default(name: str, key: str, default: Any) -> Any:
        if meta.header.has(key):
            return meta.get(key)
        defaulted.append(Defaulted(name, default, GEMMA3_SOURCES[name]))
        return default

    every = GEMMA3_GLOBAL_EVERY
    if meta.header.has(f"{arch}.attention.sliding_window_pattern"):
        every = meta.int(f"{arch}.attention.sliding_window_pattern")
        if every < 1:
            raise CheckpointError(f"{meta.name}: {arch}.attention.sliding_window_pattern must be at least 1")
    else:
        defaulted.append(Defaulted("attn_types", f"global every {every}th layer", GEMMA3_SOURCES["attn_types"]))
    types = tuple("local" if (i + 1) % every else "global" for i in range(n_layers))
    scalar = d_model / n_heads if n_layers == 62 else d_head
    defaulted.append(Defaulted("attn_scale", math.sqrt(scalar), GEMMA3_SOURCES["attn_scale"]))
    fields = {
        "window_size": meta.int(f"{arch}.attention.sliding_window"),
        "attn_types": types if "local" in types else None,
        "rotary_base_local": float(
            read_or_default("rotary_base_local", f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)
        ),
        "attn_scale": math.sqrt(scalar),
        "act_fn": "gelu_new",  # GeGLU: tanh GELU
        "post_norms": True,
    }
    if meta.header.has(f"{arch}.final_logit_softcapping"):
        fields["output_logits_soft_cap"] = meta.float(f"{arch}.final_logit_softcapping")
    if meta.header.has(f"{arch}.attn_logit_softcapping"):
        raise CheckpointError(
            f"{meta.name}: {arch}.attn_logit_softcapping is set, but Gemma 3 never applies it (transformers, "
            f"llama.cpp): refused rather than run a cap the model does not have"
        )
    return fields, defaulted


def gguf_config(header: GGUFHeader, d_vocab: int, attention_bias: bool = False) -> tuple[ModelConfig, list[Defaulted]]:
    """ModelConfig of a GGUF from its metadata (`{arch}.block_count`, ...) and the values defaulted.
    `attention_bias`: the file has q/k/v biases (Qwen2); the model's other biases (b_O, MLP, b_U) are then zero."""
    meta = Metadata(header)
    arch, kind = _architecture(meta)
    d_model, n_heads = meta.int(f"{arch}.embedding_length"), meta.int(f"{arch}.attention.head_count")
    if n_heads < 1:
        raise CheckpointError(f"{meta.name}: {arch}.attention.head_count must be at least 1")
    if not meta.header.has(f"{arch}.attention.key_length") and d_model % n_heads:
        raise CheckpointError(f"{meta.name}: embedding_length {d_model} is not divisible by head_count {n_heads}")
    d_head = meta.int(f"{arch}.attention.key_length", d_model // n_heads)
    if meta.int(f"{arch}.attention.value_length", d_head) != d_head:
        raise CheckpointError(f"{meta.name}: {arch}.attention.value_length differs from key_length (not supported)")
    n_kv = meta.int(f"{arch}.attention.head_count_kv", n_heads)
    n_layers = meta.int(f"{arch}.block_count")
    fields: dict[str, Any] = {}
    defaulted: list[Defaulted] = []
    if kind.gemma:
        fields, defaulted = _gemma_fields(meta, arch, n_layers, d_head, d_model, n_heads)
    if kind.gpt_oss:
        fields, extra = gpt_oss_fields(meta, arch, n_layers, d_head)
        defaulted += [Defaulted(*d) for d in extra]
    if kind.fused and meta.header.has(f"{arch}.attention.sliding_window"):
        fields["window_size"] = meta.int(f"{arch}.attention.sliding_window")  # every layer, as transformers' Phi-3
    if kind.qk_norm:
        fields["qk_norm"] = kind.qk_norm
    fields |= expert_fields(meta, arch, kind.norm_topk)  # an expert's width replaces feed_forward_length
    fields.setdefault("d_mlp", meta.int(f"{arch}.feed_forward_length"))
    try:
        cfg = ModelConfig(
            n_layers=n_layers, d_model=d_model, n_heads=n_heads, d_head=d_head,
            d_vocab=d_vocab, n_ctx=meta.int(f"{arch}.context_length"),
            attn_only=False, normalization_type="RMS", positional_embedding_type="rotary",
            act_fn=fields.pop("act_fn", "silu"), gated_mlp=True, n_key_value_heads=n_kv,
            eps=meta.float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5), use_bias=attention_bias,
            rotary_dim=meta.int(f"{arch}.rope.dimension_count", d_head),
            rotary_base=meta.float(f"{arch}.rope.freq_base", 10000.0), rotary_adjacent_pairs=kind.adjacent_pairs,
            bos_token_id=_token_id(meta, "tokenizer.ggml.bos_token_id", d_vocab),
            **({} if kind.gpt_oss else _rope_scaling(meta, arch, kind.gemma)), **fields,
        )  # fmt: skip
    except (InvalidInputError, TypeError) as exc:
        raise CheckpointError(f"{meta.name}: {exc}") from exc
    return cfg, defaulted


def _token_id(meta: Metadata, key: str, d_vocab: int) -> int | None:
    """The token id the metadata names under `key` (None when absent); an id outside the vocabulary is refused,
    since every answer would otherwise start from another BOS than the file says."""
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < d_vocab:
        raise CheckpointError(f"{key} {value!r} is not a token id (vocabulary {d_vocab})")
    return value


def gguf_state(cfg: ModelConfig, kind: Architecture, tensors: Tensors) -> State:
    """TransformerLens state dict of a GGUF (see the module docstring for the layouts)."""
    d, H, dh, d_vocab = cfg.d_model, cfg.n_heads, cfg.d_head, cfg.d_vocab
    n_kv, d_mlp = cfg.n_key_value_heads or H, cfg.d_mlp or 0
    gemma = kind.gemma
    # Gemma embeds x sqrt(d_model), rounded to float32 as transformers' Gemma3TextScaledWordEmbedding
    W_E, W_U = tensors.embeddings(d_vocab, d, d**0.5 if gemma else None)
    sd: State = {"embed.W_E": W_E, "unembed.W_U": W_U}  # [d_vocab, d_model], [d_model, d_vocab]
    sd["ln_final.w"] = tensors.need("output_norm.weight", (d,))
    norms = {"ln1": "attn_norm", "ln2": "post_attention_norm" if kind.gpt_oss else "ffn_norm"} | (
        {"ln1_post": "post_attention_norm", "ln2_post": "post_ffw_norm"} if gemma else {}
    )
    layers: list[State] = [{} for _ in range(cfg.n_layers)]

    def read_layer(part: slice) -> None:  # one layer's tensors, into layers[layer]
        layer = part.start
        out = layers[layer]
        b, p = f"blk.{layer}", f"blocks.{layer}"
        for ours, theirs in norms.items():  # gains as stored (Gemma's files hold 1 + w already)
            out[f"{p}.{ours}.w"] = tensors.need(f"{b}.{theirs}.weight", (d,))
        if kind.fused:  # attn_qkv [(n_heads + 2 n_kv) d_head, d_model]: q's rows, then k's, then v's
            qkv = tensors.need(f"{b}.attn_qkv.weight", ((H + 2 * n_kv) * dh, d))
            W_Q, W_K, W_V = qkv.split([H * dh, n_kv * dh, n_kv * dh])
        else:
            W_Q = tensors.need(f"{b}.attn_q.weight", (H * dh, d))  # rows (head, d_head)
            W_K, W_V = (tensors.need(f"{b}.attn_{x}.weight", (n_kv * dh, d)) for x in "kv")
        out[f"{p}.attn.W_Q"] = laid_out(W_Q.view(H, dh, d).transpose(1, 2), F32)  # [n_heads, d_model, d_head]
        for x, W in (("K", W_K), ("V", W_V)):  # rows (head, d_head) -> [n_kv, d_model, d_head]
            out[f"{p}.attn._W_{x}"] = laid_out(W.reshape(n_kv, dh, d).transpose(1, 2), F32)
        if kind.qk_norm:  # gains [d_head] per head, or [heads * d_head] over the layer's heads
            size_q, size_k = (dh, dh) if kind.qk_norm == "head" else (H * dh, n_kv * dh)
            out[f"{p}.attn.q_norm.w"] = tensors.need(f"{b}.attn_q_norm.weight", (size_q,))
            out[f"{p}.attn.k_norm.w"] = tensors.need(f"{b}.attn_k_norm.weight", (size_k,))
        if cfg.use_bias:  # q/k/v biases [heads * d_head] -> [heads, d_head]; the rest of Qwen2 has none
            out[f"{p}.attn.b_Q"] = tensors.need(f"{b}.attn_q.bias", (H * dh,)).reshape(H, dh)
            out[f"{p}.attn._b_K"] = tensors.need(f"{b}.attn_k.bias", (n_kv * dh,)).reshape(n_kv, dh)
            out[f"{p}.attn._b_V"] = tensors.need(f"{b}.attn_v.bias", (n_kv * dh,)).reshape(n_kv, dh)
        if kind.gpt_oss:
            take_gpt_oss_extras(tensors, b, p, H, cfg.num_experts or 0, d, d_mlp, out)
        elif cfg.use_bias:
            out[f"{p}.attn.b_O"], out[f"{p}.mlp.b_in"], out[f"{p}.mlp.b_out"] = (
                torch.zeros(d),
                torch.zeros(d_mlp),
                torch.zeros(d),
            )
        # attn_output [d_model(out), n_heads * d_head(in)] -> W_O [n_heads, d_head, d_model]
        out[f"{p}.attn.W_O"] = tensors.need_transposed(f"{b}.attn_output.weight", (d, H * dh)).view(H, dh, d)
        if cfg.num_experts:
            take_experts(tensors, b, p, cfg.num_experts, d, d_mlp, out)
            return
        if kind.fused:  # ffn_up [2 d_mlp, d_model]: the gate's rows, then the up projection's
            gate_up = tensors.need_transposed(f"{b}.ffn_up.weight", (2 * d_mlp, d))  # [d_model, 2 d_mlp]
            out[f"{p}.mlp.W_gate"], out[f"{p}.mlp.W_in"] = (
                gate_up[:, :d_mlp].contiguous(),
                gate_up[:, d_mlp:].contiguous(),
            )
        else:
            out[f"{p}.mlp.W_gate"] = tensors.need_transposed(f"{b}.ffn_gate.weight", (d_mlp, d))  # [d_model, d_mlp]
            out[f"{p}.mlp.W_in"] = tensors.need_transposed(f"{b}.ffn_up.weight", (d_mlp, d))  # [d_model, d_mlp]
        out[f"{p}.mlp.W_out"] = tensors.need_transposed(f"{b}.ffn_down.weight", (d, d_mlp))  # [d_mlp, d_model]

    # Layer by layer, two threads taking the layers in turn (the load runs on one torch thread: schedule.one_thread),
    # then merged in layer order
    split_loop(cfg.n_layers, 1, read_layer, "qkov-gguf-layers")
    for one in layers:
        sd.update(one)
    if cfg.use_bias:
        sd["unembed.b_U"] = torch.zeros(d_vocab)
    tensors.finish()
    return sd


def read_gguf(
    path: Path, check: Callable[[ModelConfig], None] | None = None, tokenizer_gate: threading.Event | None = None
) -> GGUFModel:
    """The config, TransformerLens state dict in float32, key -> file name, tokenizer and defaulted values of one
    GGUF file. `check(cfg)` runs once the config is known, before any tensor is dequantised (a price check may
    refuse) and before the tokenizer's arrays are decoded. A SentencePiece vocabulary (Gemma's: ~4 CPU-s, mostly
    Python holding the GIL) is built on the worker thread once `tokenizer_gate` is set: the caller sets it when its
    own work is done, a failed one included (load_checkpoint: once the model is built), or else the builder waits
    for ever; without a gate it starts once the weights are read."""
    with GGUFHeader(path) as header:
        embed = header.tensors.get("token_embd.weight")
        if embed is None:
            raise CheckpointError(f"{path.name}: missing tensor token_embd.weight")
        d_vocab = int(embed.shape[0])  # numpy shape [d_vocab, d_model]
        arch = str(header.value("general.architecture"))
        own = OWN_LAYOUTS.get(arch)
        if own is not None:  # a layout of its own (ALiBi and LayerNorms; latent attention)
            meta = Metadata(header)
            cfg, extra = own[0](meta, d_vocab, _token_id(meta, "tokenizer.ggml.bos_token_id", d_vocab))
            defaulted = [Defaulted(*d) for d in extra]
        else:
            cfg, defaulted = gguf_config(header, d_vocab, attention_bias="blk.0.attn_q.bias" in header.tensors)
        if check is not None:
            check(cfg)
        # Never beside the read: the build took a core from it and stalled its threads on the GIL (the embedding's
        # pass 3.6 s alone, 8.5 s beside it). Set in every case, a failed read included, or the builder waits for ever.
        weights_read = threading.Event()
        try:
            try:
                start = weights_read if tokenizer_gate is None else tokenizer_gate
                tokenizer = gguf_tokenizer(header, arch, d_vocab, cfg.bos_token_id, start=start)
            except CheckpointError as exc:  # a tokenizer this code does not build: a tokenizer.json beside is used
                if not (path.parent / TOKENIZER_BESIDE).is_file():
                    raise
                tokenizer = None  # the load reads the folder's tokenizer.json (checkpoint._build)
                defaulted.append(
                    Defaulted("tokenizer", TOKENIZER_BESIDE, f"the file's own tokenizer is not read: {exc}")
                )
            with one_thread():  # thousands of short ops: see llama.one_thread
                tensors = Tensors(header)
                state = own[1](cfg, tensors) if own is not None else gguf_state(cfg, ARCHITECTURES[arch], tensors)
        finally:
            weights_read.set()
    return GGUFModel(cfg, state, dict.fromkeys(state, path.name), tokenizer, defaulted)
